"""Which replicas to prefer for a request that names a LoRA adapter. Pure.

Every replica of the base model may serve any of its adapters (the operator loads them all into
every pod), but a replica can batch only `--max-loras` adapters at once: one already running or
queueing the adapter serves it at once, one with a free slot after swapping it in, and one whose
slots are all taken only once a slot frees. So, as the Inference Extension's LoRA-affinity
scorer on `vllm:lora_requests_info` does, the replicas are tried in three tiers: holding the
adapter, with a free slot, the rest; within the load bound first (the strategy's own pick among
the tier's replicas under the bound computed over all of them), and past the bound the whole
route's pick, load alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.contract.metric_names import LORA_REQUESTS_INFO
from kvpilot.gateway.routing.picking import ReplicaLoad, load_bound
from kvpilot.gateway.routing.routes import Backend


@dataclass(frozen=True)
class LoraState:
    """One replica's adapters in use, as its last `vllm:lora_requests_info` said."""

    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_lora: int = 0

    def holds(self, adapter: str) -> bool:
        return adapter in self.running or adapter in self.waiting

    @property
    def has_free_slot(self) -> bool:
        return len(self.running | self.waiting) < self.max_lora


def parse_lora_info(text: str) -> LoraState | None:
    """The newest `vllm:lora_requests_info` sample of a replica's /metrics text (None: none)."""
    lines = "\n".join(
        line for line in text.splitlines() if line.startswith(LORA_REQUESTS_INFO + "{")
    )
    samples = [s for f in text_string_to_metric_families(lines) for s in f.samples]
    if not samples:
        return None
    newest = max(samples, key=lambda s: s.value).labels
    return LoraState(
        running=_names(newest.get("running_lora_adapters", "")),
        waiting=_names(newest.get("waiting_lora_adapters", "")),
        max_lora=int(float(newest.get("max_lora") or 0)),
    )


def _names(text: str) -> frozenset[str]:
    return frozenset(name for name in text.split(",") if name)


def tiers(
    adapter: str, backends: Sequence[Backend], states: Mapping[str, LoraState]
) -> list[list[Backend]]:
    """The backends holding `adapter`, those with a free slot (or not reporting), the rest."""
    holding, free, full = [], [], []
    for backend in backends:
        state = states.get(backend.name)
        if state is not None and state.holds(adapter):
            holding.append(backend)
        elif state is None or state.has_free_slot:
            free.append(backend)
        else:
            full.append(backend)
    return [tier for tier in (holding, free, full) if tier]


def preferred(
    adapter: str,
    backends: Sequence[Backend],
    loads: Mapping[str, ReplicaLoad],
    states: Mapping[str, LoraState],
    load_factor: float,
    kv_hot: float,
) -> list[Backend]:
    """The replicas to pick among: those of the first tier with one under the load bound and
    not hot (the bound over all `backends`, counting the new request), else every backend (all
    past the bound: load alone decides)."""
    load = {b.name: loads.get(b.name, ReplicaLoad()) for b in backends}
    bound = load_bound([load[b.name].total for b in backends], load_factor)
    for tier in tiers(adapter, backends, states):
        within = _within(tier, load, bound, kv_hot)
        if within:
            return within
    return list(backends)


def _within(
    tier: Iterable[Backend], load: Mapping[str, ReplicaLoad], bound: float, kv_hot: float
) -> list[Backend]:
    return [b for b in tier if load[b.name].total + 1 <= bound and load[b.name].kv_usage < kv_hot]
