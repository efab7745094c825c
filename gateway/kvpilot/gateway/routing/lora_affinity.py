"""Which replicas to prefer for a request that names a LoRA adapter. Pure.

The operator places each adapter on as many replicas as its demand needs (hot ones on every
replica, cold ones on few: operator adapters/assignment.py), and a replica can batch only
`--max-loras` adapters at once: one already running or queueing the adapter serves it at once,
one that holds it with a free slot after swapping it in, one whose slots are all taken only once
a slot frees, and one that does not hold it answers 404. So, as the Inference Extension's
LoRA-affinity scorer on `vllm:lora_requests_info` does, the replicas are tried in tiers: running
or queueing the adapter, holding it (kvpilot's `kvpilot_lora_adapter_loaded`; a replica that
does not report what it holds, e.g. vLLM, counts as holding it) with a free slot, holding it with
its slots taken; never those that report it is not loaded, unless all do; within the load bound
first (the strategy's own pick among the tier's replicas under the bound computed over all of
them), and past the bound the pick of the replicas that hold it, load alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.contract.metric_names import LORA_ADAPTER_LOADED, LORA_NAME_LABEL, LORA_REQUESTS_INFO
from kvpilot.gateway.routing.picking import ReplicaLoad, load_bound
from kvpilot.gateway.routing.routes import Backend


@dataclass(frozen=True)
class LoraState:
    """One replica's adapters in use, as its last `vllm:lora_requests_info` said, and those it
    holds (`kvpilot_lora_adapter_loaded`; None: it does not say, as vLLM does not)."""

    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_lora: int = 0
    loaded: frozenset[str] | None = None

    def in_use(self, adapter: str) -> bool:
        return adapter in self.running or adapter in self.waiting

    def lacks(self, adapter: str) -> bool:
        """It says what it holds, and not this adapter (it would answer 404)."""
        return self.loaded is not None and adapter not in self.loaded and not self.in_use(adapter)

    @property
    def has_free_slot(self) -> bool:
        return len(self.running | self.waiting) < self.max_lora


def parse_lora_info(text: str) -> LoraState | None:
    """The newest `vllm:lora_requests_info` sample of a replica's /metrics text and the adapters
    it holds (None: no lora_requests_info)."""
    info = LORA_REQUESTS_INFO + "{"
    loaded_prefix = LORA_ADAPTER_LOADED + "{"
    wanted = [line for line in text.splitlines() if line.startswith((info, loaded_prefix))]
    families = list(text_string_to_metric_families("\n".join(wanted)))
    info_samples = [s for f in families if f.name == LORA_REQUESTS_INFO for s in f.samples]
    if not info_samples:
        return None
    newest = max(info_samples, key=lambda s: s.value).labels
    held = [s for f in families if f.name == LORA_ADAPTER_LOADED for s in f.samples]
    loaded = None
    # a replica holding no adapter exports the gauge's TYPE line without a sample
    if held or f"# TYPE {LORA_ADAPTER_LOADED} " in text:
        loaded = frozenset(s.labels.get(LORA_NAME_LABEL, "") for s in held if s.value > 0)
    return LoraState(
        running=_names(newest.get("running_lora_adapters", "")),
        waiting=_names(newest.get("waiting_lora_adapters", "")),
        max_lora=int(float(newest.get("max_lora") or 0)),
        loaded=loaded,
    )


def _names(text: str) -> frozenset[str]:
    return frozenset(name for name in text.split(",") if name)


def tiers(
    adapter: str, backends: Sequence[Backend], states: Mapping[str, LoraState]
) -> list[list[Backend]]:
    """The backends running or queueing `adapter`, those holding it with a free slot (or not
    reporting), those holding it without one; those that lack it only when all do (an adapter
    being loaded: they answer 404 and the request moves on)."""
    in_use, free, full, lacking = [], [], [], []
    for backend in backends:
        state = states.get(backend.name)
        if state is None:
            free.append(backend)
        elif state.in_use(adapter):
            in_use.append(backend)
        elif state.lacks(adapter):
            lacking.append(backend)
        elif state.has_free_slot:
            free.append(backend)
        else:
            full.append(backend)
    holding = [tier for tier in (in_use, free, full) if tier]
    return holding or ([lacking] if lacking else [])


def preferred(
    adapter: str,
    backends: Sequence[Backend],
    loads: Mapping[str, ReplicaLoad],
    states: Mapping[str, LoraState],
    load_factor: float,
    kv_hot: float,
) -> list[Backend]:
    """The replicas to pick among: those of the first tier with one under the load bound and
    not hot (the bound over all `backends`, counting the new request), else (all past the bound:
    load alone decides) every backend that may hold it, or every backend when none says so."""
    load = {b.name: loads.get(b.name, ReplicaLoad()) for b in backends}
    bound = load_bound([load[b.name].total for b in backends], load_factor)
    for tier in tiers(adapter, backends, states):
        within = _within(tier, load, bound, kv_hot)
        if within:
            return within
    holders = [b for b in backends if not _lacks(states.get(b.name), adapter)]
    return holders or list(backends)


def _lacks(state: LoraState | None, adapter: str) -> bool:
    return state is not None and state.lacks(adapter)


def _within(
    tier: Iterable[Backend], load: Mapping[str, ReplicaLoad], bound: float, kv_hot: float
) -> list[Backend]:
    return [b for b in tier if load[b.name].total + 1 <= bound and load[b.name].kv_usage < kv_hot]
