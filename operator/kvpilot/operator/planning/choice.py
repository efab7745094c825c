"""Which source a node type serves when several fit at the level it runs (DESIGN.md §3.3). Pure.

The level is the user's preference (quantization.allowed, the quality gate); within it the
sources compete on real cost: the fewest GPUs per replica first. Then a source whose quality is
known comes before kvpilot's own quantisation that nobody measured: known means measured by the
quality gate, or served as stored (a checkpoint its publisher quantised and calibrated, as AWQ,
GPTQ and llm-compressor do, or 16-bit weights at a 16-bit level). Without an eval set a user who
lists an AWQ variant gets it rather than round-to-nearest int4 of the bf16 weights, which has
fewer bytes (kvpilot's int4 also packs the embeddings and lm_head) but an unknown loss; with an
eval set every served source is measured, so the cheapest within maxQualityLoss wins. Then the
fewest weight bytes (a checkpoint's real bytes: int4 with its group scales, the modules it leaves
at 16 bits), the lower measured loss, and spec order (spec.model, then spec.model.variants[] as
listed). `explain` says which of these decided, so status.plan[].reason shows why a source won.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.contract.memory import gib


@dataclass(frozen=True)
class Fit:
    """One source that fits a node type at the level being decided."""

    label: str  # "spec.model" or "variant NAME"
    tensor_parallel: int
    weights_bytes: float  # per GPU
    loss: float | None  # percent, measured by the quality gate; None: not measured
    order: int  # 0: spec.model; i + 1: spec.model.variants[i]
    quantized_by_kvpilot: bool = False  # 16-bit weights kvpilot quantises at load (RTN)

    @property
    def unknown_quality(self) -> bool:
        return self.quantized_by_kvpilot and self.loss is None

    def key(self) -> tuple[int, bool, float, float, int]:
        loss = math.inf if self.loss is None else self.loss
        return (self.tensor_parallel, self.unknown_quality, self.weights_bytes, loss, self.order)


def best(fits: Sequence[Fit]) -> Fit:
    """The cheapest by `Fit.key`; ValueError when nothing fits."""
    if not fits:
        raise ValueError("no source fits")
    return min(fits, key=Fit.key)


def explain(winner: Fit, fits: Sequence[Fit]) -> str:
    """'' when the winner was alone; else, for each other source, what decided against it, e.g.
    `spec.model over variant awq (weights 3.77 vs 5.26 GiB per GPU)`."""
    others = [f"{f.label} ({_decided_by(winner, f)})" for f in fits if f.label != winner.label]
    return f"{winner.label} over {', '.join(others)}" if others else ""


def _decided_by(winner: Fit, other: Fit) -> str:
    if winner.tensor_parallel != other.tensor_parallel:
        return f"{winner.tensor_parallel} vs {other.tensor_parallel} GPUs per replica"
    if winner.unknown_quality != other.unknown_quality:
        return "served as published; kvpilot's own quantisation of it is not measured"
    if winner.weights_bytes != other.weights_bytes:
        return f"weights {_sizes(winner.weights_bytes, other.weights_bytes)} per GPU"
    if winner.loss != other.loss:
        theirs = "not measured" if other.loss is None else f"{other.loss:+.2f}%"
        return f"measured loss {winner.loss:+.2f}% vs {theirs}"
    return "listed first"


def _sizes(a: float, b: float) -> str:
    """Two sizes in one unit: GiB, or MiB below 1 GiB (a tiny model's 0.00 vs 0.00 says nothing)."""
    if max(a, b) >= 2**30:
        return f"{gib(a):.2f} vs {gib(b):.2f} GiB"
    return f"{a / 2**20:.1f} vs {b / 2**20:.1f} MiB"
