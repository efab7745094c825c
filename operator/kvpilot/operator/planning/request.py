"""What the planner is asked (planner.py, DESIGN.md §3.3): a PlanRequest, built from a
ModelDeployment's spec at the edge (its model facts, the levels quality admits, the serving
targets, the placement bounds, the container's memory request, the adapter slots), and the
candidates (a source of the model at a level) a node type may serve. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes.utils import parse_quantity

from kvpilot.contract import memory
from kvpilot.contract.memory import ModelFacts
from kvpilot.operator.api import ModelDeploymentSpec, allowed_quantizations


@dataclass(frozen=True)
class PlanRequest:
    facts: ModelFacts
    quantizations: tuple[str, ...]
    max_context_length: int
    target_concurrency: int
    kv_bytes: int = 2
    gpu_memory_utilization: float = 0.9
    max_gpus_per_replica: int = 8
    min_gpus_per_replica: int = 1
    prefer: str = "quality"
    node_types: tuple[str, ...] = ()  # empty: every node type in the cluster
    # (node type, $ per 1,000 requests) measured on real traffic (status.cost.nodeTypes)
    measured_cost: tuple[tuple[str, float], ...] = ()
    # speculative draft_model: the draft's facts; it runs on each replica's GPU 0
    draft: ModelFacts | None = None
    # the container's memory request in bytes (the user's plus a host KV tier): a node type
    # whose nodes have less cannot run a replica; 0: none asked for
    memory_bytes: int = 0
    # spec.runtime.kvOffload: the runtime's KV tiers run with one GPU per replica
    has_kv_offload: bool = False
    # LoRA adapter slots (memory.lora_slot_bytes), counted whole on every GPU: under tensor
    # parallelism each rank holds its shard of them, so this is an upper bound
    lora_bytes: float = 0.0

    # spec.model.variants[]: (name, facts) of the same model published other ways
    variants: tuple[tuple[str, ModelFacts], ...] = ()
    # The quality gate's (source, level) pairs ("" = spec.model; quality/variants.py): only
    # these are candidates; None: every source at every allowed level (no eval set)
    admitted: tuple[tuple[str, str], ...] | None = None
    # The gate's measured losses (percent) by loss_key: among sources that fit at one level and
    # tie on GPUs and weight bytes, the lower measured loss wins (choice.py)
    losses: tuple[tuple[str, float], ...] = ()

    def candidates(self) -> list[Candidate]:
        """What a node type may serve: for each allowed level in preference order, the
        pre-quantised checkpoints of that level (they fix their level: the runtime does not
        re-quantise them), then the 16-bit ones quantised by kvpilot. Which of one level's
        candidates wins where several fit is choice.py's (real cost, not this order)."""
        sources = [("", self.facts), *self.variants]
        ranked = sorted(enumerate(sources), key=lambda s: s[1][1].checkpoint is None)
        return [
            Candidate(name, facts, _own_level(facts) or level, order)
            for level in self.quantizations
            for order, (name, facts) in ranked
            if _own_level(facts) is None or rank_level(_own_level(facts) or "") == level
            if self.admitted is None or (name, level) in self.admitted
        ]

    def __post_init__(self) -> None:
        if not self.quantizations:
            raise ValueError("no quantisation level allowed: quantization.allowed is empty")
        if self.prefer not in ("quality", "cost"):
            raise ValueError(f"prefer must be quality or cost, got {self.prefer!r}")
        if self.max_context_length < 1 or self.target_concurrency < 1:
            raise ValueError("maxContextLength and targetConcurrency must be positive")

    @classmethod
    def from_spec(
        cls,
        spec: ModelDeploymentSpec,
        facts: ModelFacts,
        quantizations: tuple[str, ...] | None = None,
        draft: ModelFacts | None = None,
    ) -> PlanRequest:
        """`quantizations`: the levels quality admits (quality.admit); default: the category's.
        `draft`: the facts of spec.serving.speculative's draft model, if it names one."""
        names = tuple(spec.placement.node_types)
        return cls(
            facts=facts,
            quantizations=allowed_quantizations(spec.quantization)
            if quantizations is None
            else quantizations,
            max_context_length=spec.serving.max_context_length,
            target_concurrency=spec.serving.target_concurrency,
            kv_bytes=memory.kv_dtype_bytes(spec.serving.kv_cache_dtype),
            gpu_memory_utilization=spec.serving.gpu_memory_utilization,
            max_gpus_per_replica=spec.placement.max_gpus_per_replica,
            min_gpus_per_replica=spec.placement.min_gpus_per_replica,
            prefer=spec.placement.prefer,
            node_types=() if names == ("auto",) else names,
            draft=draft,
            memory_bytes=memory_request_bytes(spec),
            has_kv_offload=spec.runtime.kv_offload is not None,
            lora_bytes=adapter_slot_bytes(spec, facts),
        )


@dataclass(frozen=True)
class Candidate:
    variant: str  # "": spec.model
    facts: ModelFacts
    quantization: str  # the runtime's --quantization
    order: int = 0  # spec order: 0 spec.model, i + 1 spec.model.variants[i]

    @property
    def label(self) -> str:
        return f"variant {self.variant}" if self.variant else "spec.model"


def _own_level(facts: ModelFacts) -> str | None:
    return None if facts.checkpoint is None else facts.checkpoint.level


def rank_level(quantization: str) -> str:
    """The allowed level a checkpoint's level ranks as: fp8 (`none`, dequantised at load into
    the compute dtype) as bf16."""
    return "bf16" if quantization == "none" else quantization


def memory_request_bytes(spec: ModelDeploymentSpec) -> int:
    """The runtime container's memory request as the operator writes it: the user's plus the
    host KV tier (spec.runtime.kvOffload.hostGiB); 0 when neither is given."""
    offload = spec.runtime.kv_offload
    if offload is not None:
        user_memory_bytes(spec, "limits")  # grown by the tier too: refused here if unreadable
    return user_memory_bytes(spec, "requests") + (0 if offload is None else offload.host_bytes)


def user_memory_bytes(spec: ModelDeploymentSpec, kind: str) -> int:
    """spec.runtime.resources' memory request or limit (`kind`) in bytes; 0 when not given."""
    value = spec.runtime.resources.get(kind, {}).get("memory")
    try:
        return 0 if value is None else int(parse_quantity(value))
    except ValueError as error:
        raise ValueError(
            f"spec.runtime.resources.{kind}.memory {value!r} is not a Kubernetes quantity"
            " (e.g. 16Gi)"
        ) from error


def adapter_slot_bytes(spec: ModelDeploymentSpec, facts: ModelFacts) -> float:
    """The adapter slots' memory per replica (0 without LoRA)."""
    if not spec.lora_enabled:
        return 0.0
    slots = spec.lora_slots
    return memory.lora_slot_bytes(facts, slots.max_loras, slots.max_lora_rank)
