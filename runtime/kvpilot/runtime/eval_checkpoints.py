"""`kvpilot-runtime eval --checkpoint NAME=PATH`: another published checkpoint of the same model
(a spec.model.variants[] entry, fetched as a model is: AWQ, GPTQ, compressed-tensors, FP8, or
16-bit) scored against the same baseline, on the same samples, with the same metric, as
kvpilot's own levels, so its row and theirs are comparable.

It is loaded as `serve` loads it (model_runner.load_model, `--quantization none`: a pre-quantised
checkpoint keeps its own format) in the baseline's compute dtype, so the difference measured is
the checkpoint's weights alone. The samples are the baseline's tokens: a variant is the same model
published another way, and one whose architecture differs is refused naming the fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvpilot.runtime.models.loader import ModelConfig, load_model_config

# A spec.model.variants[] name (a DNS label), which also keys the summary the operator reads.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# What must match for the baseline's tokens and context to mean the same to the candidate.
_ARCHITECTURE = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class Candidate:
    """A checkpoint to score: its name in the output, its local directory."""

    name: str
    path: Path


def parse_candidate(text: str) -> Candidate:
    """`NAME=PATH`, e.g. `awq=/models/variants/awq`; ValueError saying what is wrong."""
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise ValueError(f"--checkpoint {text!r}: expected NAME=PATH (e.g. awq=/models/awq)")
    if _NAME.fullmatch(name) is None:
        raise ValueError(
            f"--checkpoint {text!r}: the name {name!r} must be lower-case letters, digits and '-'"
            " (a spec.model.variants[] name)"
        )
    return Candidate(name, Path(path))


def parse_candidates(values: list[str], levels: list[str]) -> list[Candidate]:
    """Every `--checkpoint`, refusing a name used twice or shared with a level."""
    candidates = [parse_candidate(v) for v in values]
    names = [c.name for c in candidates]
    clashes = sorted({n for n in names if names.count(n) > 1 or n in levels})
    if clashes:
        raise ValueError(
            f"--checkpoint names {clashes} are used twice or name a --quantization level: each"
            " row needs its own name"
        )
    return candidates


def candidate_config(candidate: Candidate, baseline: ModelConfig) -> ModelConfig:
    """The candidate's config, or ValueError when it is not the baseline's architecture."""
    cfg = load_model_config(candidate.path)
    differ = [
        f"{field} {getattr(cfg, field)} vs {getattr(baseline, field)}"
        for field in _ARCHITECTURE
        if getattr(cfg, field) != getattr(baseline, field)
    ]
    if differ:
        raise ValueError(
            f"--checkpoint {candidate.name} ({candidate.path}) is not the baseline model's"
            f" architecture: {', '.join(differ)}; a candidate is the same model published"
            " another way"
        )
    return cfg


def checkpoint_level(cfg: ModelConfig) -> str:
    """The level the checkpoint runs at as stored: its quantisation's (int4, int8; fp8 runs
    dequantised, `none`), or bf16 for a 16-bit checkpoint, the operator's name for it."""
    if cfg.checkpoint_quant is None:
        return "bf16"
    return cfg.checkpoint_quant.level


def checkpoint_format(cfg: ModelConfig) -> str:
    """e.g. `compressed-tensors int4 (pack-quantized, group 128)`; `16-bit` when unquantised."""
    return "16-bit" if cfg.checkpoint_quant is None else cfg.checkpoint_quant.describe()
