"""Which quantisation and tensor-parallel degree fits each node type (DESIGN.md §3.3). Pure.

For each node type: the first level in the user's preference order, and for it the smallest
tensor-parallel degree (1, 2, 4, 8, within the GPUs of one node), such that weights + KV cache for
`maxContextLength x targetConcurrency` + overhead fit in `gpu memory x utilisation` per GPU; where
several sources (spec.model, spec.model.variants[]) fit at that level, the cheapest (choice.py). The
numbers come from `kvpilot.contract.memory`, the module the runtime sizes its KV pool with, so what
the operator promises is what the pod will allocate. When nothing fits, the cheapest option tried is
reported with its numbers.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

from kvpilot.contract import memory
from kvpilot.contract.checkpoint_quant import SIXTEEN_BIT
from kvpilot.contract.memory import MemoryEstimate, ModelFacts
from kvpilot.operator.api import ModelDeploymentSpec, PlanEntry, allowed_quantizations
from kvpilot.operator.autoscaling.spread import spread_replicas
from kvpilot.operator.planning import choice
from kvpilot.operator.planning.inventory import NodeType

TP_DEGREES = (1, 2, 4, 8)
# Largest first: an eval's reference is the first of these some node type fits (reference_plan).
REFERENCE_LEVELS = ("bf16", "int8", "int4")
_GIB_FIELDS = (
    ("weightsGiB", "weights_bytes"),
    ("kvCacheGiB", "kv_cache_bytes"),
    ("overheadGiB", "overhead_bytes"),
    ("usableGiB", "usable_bytes"),
)


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


def checkpoint_kind(facts: ModelFacts) -> str:
    """How the checkpoint stores its weights, as the runtime's --expect-checkpoint names it."""
    return SIXTEEN_BIT if facts.checkpoint is None else facts.checkpoint.kind


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


@dataclass(frozen=True)
class NodePlan:
    node_type: NodeType
    fits: bool
    quantization: str = ""
    tensor_parallel: int = 0
    estimate: MemoryEstimate | None = None
    max_concurrency: int = 0
    reason: str = ""
    memory_bytes: int = 0  # the container's memory request (PlanRequest.memory_bytes)
    variant: str = ""  # the spec.model.variants[] name served; "": spec.model
    choice: str = ""  # why this source won where several fit (choice.explain); "": alone
    # How the served checkpoint stores its weights (checkpoint_quant.CHECKPOINT_KINDS, e.g.
    # awq-int4): the pod's --expect-checkpoint where the plan came from a given config.json
    checkpoint: str = SIXTEEN_BIT

    @property
    def price_per_replica_hour(self) -> float:
        return self.node_type.price_per_gpu_hour() * self.tensor_parallel

    def num_free_slots(self) -> int:
        if not self.fits:
            return 0
        return self.node_type.num_free_slots(self.tensor_parallel, self.memory_bytes)


def plan(request: PlanRequest, node_types: Iterable[NodeType]) -> list[NodePlan]:
    """A verdict per node type, fitting ones first in the order `prefer` asks for."""
    by_name = {nt.name: nt for nt in node_types}
    names = request.node_types or tuple(by_name)
    plans = [
        plan_node_type(request, by_name[name]) if name in by_name else _unknown(name)
        for name in names
    ]
    return order(plans, request)


def plan_node_type(request: PlanRequest, node_type: NodeType) -> NodePlan:
    degrees = tp_degrees(request, node_type)
    if not degrees:
        return NodePlan(node_type, fits=False, reason=_no_degree_reason(request, node_type))
    if 0 < node_type.memory_bytes < request.memory_bytes:
        return NodePlan(node_type, fits=False, reason=_memory_reason(request, node_type))
    options = [(c, tp) for c in request.candidates() for tp in degrees if _runs(c, tp)]
    if not options:
        return NodePlan(node_type, fits=False, reason=_no_candidate_reason(request, node_type))
    for level in dict.fromkeys(rank_level(c.quantization) for c, _ in options):
        fits = _fits_at(request, node_type, [o for o in options if _level_of(o) == level])
        if fits:
            return _chosen(request, node_type, fits)
    # The last option is the smallest footprint tried: the closest miss, worth reporting.
    candidate, tp = options[-1]
    estimate = _estimate(request, node_type, candidate, tp)
    return NodePlan(
        node_type,
        fits=False,
        quantization=candidate.quantization,
        tensor_parallel=tp,
        estimate=estimate,
        reason=f"{node_type.name}: {_candidate_text(candidate)}{_tp_text(tp)} needs"
        f" {estimate.describe()}"
        + (_ONE_GPU_FOR_TIERS if request.has_kv_offload and node_type.gpus_per_node > 1 else ""),
        variant=candidate.variant,
        checkpoint=checkpoint_kind(candidate.facts),
    )


def _level_of(option: tuple[Candidate, int]) -> str:
    return rank_level(option[0].quantization)


_Fitting = tuple[Candidate, int, MemoryEstimate]


def _fits_at(
    request: PlanRequest, node_type: NodeType, options: Sequence[tuple[Candidate, int]]
) -> list[_Fitting]:
    """Each of one level's candidates at the fewest GPUs it fits on (none: it fits nowhere)."""
    found: dict[int, _Fitting] = {}
    for candidate, tp in options:
        if candidate.order in found:
            continue
        estimate = _estimate(request, node_type, candidate, tp)
        if estimate.fits:
            found[candidate.order] = (candidate, tp, estimate)
    return list(found.values())


def _chosen(request: PlanRequest, node_type: NodeType, fitting: Sequence[_Fitting]) -> NodePlan:
    """The cheapest of the sources that fit at one level (choice.py), saying why."""
    losses = dict(request.losses)
    fits = [
        choice.Fit(
            c.label,
            tp,
            e.weights_bytes,
            losses.get(loss_key(c.variant, c.quantization)),
            c.order,
            quantized_by_kvpilot=c.facts.checkpoint is None and c.quantization != "bf16",
        )
        for c, tp, e in fitting
    ]
    winner = choice.best(fits)
    candidate, tp, estimate = fitting[fits.index(winner)]
    found = _fitting(request, node_type, candidate, tp, estimate)
    why = choice.explain(winner, fits)
    reason = f"{found.reason}; {why}" if why else found.reason
    return dataclasses.replace(found, choice=why, reason=reason)


def _runs(candidate: Candidate, tp: int) -> bool:
    """A pre-quantised checkpoint runs on one GPU: its packed tensors are not split by tensor
    parallelism (checkpoint_quant.check_prequantized_parallel)."""
    return tp == 1 or candidate.facts.checkpoint is None


def _no_candidate_reason(request: PlanRequest, node_type: NodeType) -> str:
    sources = [("spec.model", request.facts)] + [
        (f"variant {name}", facts) for name, facts in request.variants
    ]
    if not request.candidates():
        found = ", ".join(f"{w} {_describe(f)}" for w, f in sources)
        return (
            f"{node_type.name}: no allowed level ({', '.join(request.quantizations)}) is one a"
            f" source runs at: {found}; allow its level (quantization.allowed, maxQualityLoss)"
        )
    return (
        f"{node_type.name}: a pre-quantised checkpoint runs on one GPU (its packed tensors are"
        f" not split), and minGpusPerReplica is {request.min_gpus_per_replica}"
    )


def _describe(facts: ModelFacts) -> str:
    checkpoint = facts.checkpoint
    return "16-bit" if checkpoint is None else f"pre-quantised {checkpoint.description}"


_ONE_GPU_FOR_TIERS = " (with runtime.kvOffload a replica has one GPU)"


def _memory_reason(request: PlanRequest, node_type: NodeType) -> str:
    tier = " with runtime.kvOffload's host tier" if request.has_kv_offload else ""
    return (
        f"{node_type.name}: a replica requests {memory.gib(request.memory_bytes):.1f} GiB of "
        f"memory{tier}, its nodes have {memory.gib(node_type.memory_bytes):.1f} GiB"
    )


def adapter_slot_bytes(spec: ModelDeploymentSpec, facts: ModelFacts) -> float:
    """The adapter slots' memory per replica (0 without LoRA)."""
    if not spec.lora_enabled:
        return 0.0
    slots = spec.lora_slots
    return memory.lora_slot_bytes(facts, slots.max_loras, slots.max_lora_rank)


def tp_degrees(request: PlanRequest, node_type: NodeType) -> list[int]:
    """Tensor-parallel degrees to try: within the GPUs per node and the spec's bounds, and only
    those that split the KV heads evenly (the runtime refuses any other). A draft model runs
    whole on GPU 0 beside its shard (memory.estimate counts it there). With KV tiers only 1: the
    runtime does not run them under tensor parallelism (nor pre-quantised checkpoints: `_runs`)."""
    max_tp = min(node_type.gpus_per_node, request.max_gpus_per_replica)
    # the runtime's KV tiers copy no other rank's KV shard
    if request.has_kv_offload:
        max_tp = min(max_tp, 1)
    return [
        tp
        for tp in TP_DEGREES
        if request.min_gpus_per_replica <= tp <= max_tp and request.facts.kv_heads % tp == 0
    ]


def _no_degree_reason(request: PlanRequest, node_type: NodeType) -> str:
    if node_type.gpus_per_node < request.min_gpus_per_replica:
        return (
            f"{node_type.name}: {node_type.gpus_per_node} GPUs per node, minGpusPerReplica is "
            f"{request.min_gpus_per_replica}"
        )
    if node_type.gpus_per_node < 1:
        return f"{node_type.name}: no GPUs per node"
    return (
        f"{node_type.name}: no tensor-parallel degree in {request.min_gpus_per_replica}.."
        f"{min(node_type.gpus_per_node, request.max_gpus_per_replica)} divides the model's "
        f"{request.facts.kv_heads} KV heads"
    )


def _candidate_text(candidate: Candidate) -> str:
    """e.g. `int4`, `variant awq: pre-quantised awq int4 (awq-gemm, group 128)`."""
    checkpoint = candidate.facts.checkpoint
    text = candidate.quantization if checkpoint is None else _describe(candidate.facts)
    return f"variant {candidate.variant}: {text}" if candidate.variant else text


def _tp_text(tp: int) -> str:
    return f" on {tp} GPUs" if tp > 1 else ""


def _estimate(
    request: PlanRequest, node_type: NodeType, candidate: Candidate, tp: int
) -> MemoryEstimate:
    return memory.estimate(
        candidate.facts,
        candidate.quantization,
        request.kv_bytes,
        tokens=request.max_context_length,
        sequences=request.target_concurrency,
        tensor_parallel=tp,
        gpu_memory_bytes=node_type.gpu_memory_bytes,
        gpu_memory_utilization=request.gpu_memory_utilization,
        draft=request.draft,
        lora_bytes=request.lora_bytes,
    )


def _fitting(
    request: PlanRequest,
    node_type: NodeType,
    candidate: Candidate,
    tp: int,
    estimate: MemoryEstimate,
) -> NodePlan:
    budget = memory.kv_budget_bytes(
        node_type.gpu_memory_bytes, request.gpu_memory_utilization, estimate.weights_bytes
    )
    concurrency = memory.max_concurrency(
        request.facts, request.kv_bytes, request.max_context_length, budget, tp, request.draft
    )
    return NodePlan(
        node_type,
        fits=True,
        quantization=candidate.quantization,
        tensor_parallel=tp,
        estimate=estimate,
        max_concurrency=max(concurrency, request.target_concurrency),
        reason=f"{node_type.name}: {_candidate_text(candidate)}{_tp_text(tp)},"
        f" {estimate.describe()}",
        memory_bytes=request.memory_bytes,
        variant=candidate.variant,
        checkpoint=checkpoint_kind(candidate.facts),
    )


def _unknown(name: str) -> NodePlan:
    placeholder = NodeType(name, "", 0, 0, 0.0, {})
    return NodePlan(placeholder, fits=False, reason=f"{name}: no such node type in the cluster")


def order(plans: Sequence[NodePlan], request: PlanRequest) -> list[NodePlan]:
    """quality: best level first, then cheaper; cost: lowest cost per request first (cost_rank).

    Unknown prices sort after known ones so a priced node type is never displaced by a guess.
    """
    rank = {q: i for i, q in enumerate(request.quantizations)}
    costs = cost_rank(plans, dict(request.measured_cost))

    def key(p: NodePlan) -> tuple[Any, ...]:
        if not p.fits:
            return (1, 0, 0.0, p.node_type.name)
        level = rank_level(p.quantization)
        if request.prefer == "cost":
            return (0, costs[p.node_type.name], rank[level], p.node_type.name)
        price = p.price_per_replica_hour or math.inf
        return (0, rank[level], price, p.node_type.name)

    return sorted(plans, key=key)


def estimated_cost(p: NodePlan) -> float:
    """The plan's estimate: $ per hour per sequence held at full context (inf: no price)."""
    return (p.price_per_replica_hour or math.inf) / max(1, p.max_concurrency)


def cost_rank(plans: Sequence[NodePlan], measured: Mapping[str, float]) -> dict[str, float]:
    """Cost per 1,000 requests per fitting node type: measured on real traffic where it was
    (status.cost), else the plan's estimate in the same unit, scaled by the median ratio of
    measured cost to estimate over the node types that have both. Without any measurement,
    the estimate itself (the order is the same)."""
    fitting = [p for p in plans if p.fits]
    ratios = [
        measured[p.node_type.name] / estimated_cost(p)
        for p in fitting
        if measured.get(p.node_type.name, 0) > 0 and math.isfinite(estimated_cost(p))
    ]
    scale = statistics.median(ratios) if ratios else 1.0
    return {
        p.node_type.name: measured.get(p.node_type.name, estimated_cost(p) * scale) for p in fitting
    }


def assign_replicas(total: int, plans: Sequence[NodePlan]) -> list[int]:
    """Spread `total` replicas over fitting node types in plan order, honouring free GPUs: the
    autoscaler's spread (autoscaling/spread.py) with nothing running yet.

    What no node type has room for goes to the first fitting type, where it waits Pending in plain
    sight (the autoscaler's spill-over moves it) rather than silently vanishing.
    """
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return [0] * len(plans)
    per_type = spread_replicas(
        max(0, total),
        [p.node_type.name for p in fitting],
        {p.node_type.name: p.num_free_slots() * p.tensor_parallel for p in fitting},
        {p.node_type.name: p.tensor_parallel for p in fitting},
        current_per_type={},
        unschedulable_since={},
        now=0.0,
        spill_after_s=math.inf,  # nothing has been Unschedulable yet
    )
    return [per_type.get(p.node_type.name, 0) if p.fits else 0 for p in plans]


def desired_total(spec: ModelDeploymentSpec, autoscaler_desired: int | None) -> int:
    """Replicas wanted in all: the scale subresource's figure, or the autoscaler's within bounds."""
    scaling = spec.autoscaling
    if scaling.mode in ("off", "external"):
        return scaling.replicas
    wanted = scaling.min_replicas if autoscaler_desired is None else autoscaler_desired
    return min(max(wanted, scaling.min_replicas), scaling.max_replicas)


def reference_plan(
    request: PlanRequest, node_types: Iterable[NodeType], tokens: int
) -> NodePlan | None:
    """Where an eval Job runs its reference (one window of `tokens`): the first node type, in
    quality order, that fits bf16 (the unquantised weights); where none does, the largest level
    that fits one (REFERENCE_LEVELS), which losses are then relative to; None if nothing fits."""
    for level in REFERENCE_LEVELS:
        reference = dataclasses.replace(
            request,
            quantizations=(level,),
            variants=(),  # the reference is spec.model's own weights
            admitted=None,
            max_context_length=tokens,
            target_concurrency=1,
            prefer="quality",
        )
        found = next((p for p in plan(reference, node_types) if p.fits), None)
        if found is not None:
            return found
    return None


def status_entries(
    plans: Sequence[NodePlan],
    replicas: Sequence[int],
    losses: Mapping[str, float] | None = None,
) -> list[PlanEntry]:
    """`losses`: measured quality loss (percent) per level, shown next to each entry's level;
    a variant's under `variant:NAME` (quality_losses)."""
    return [_entry(p, n, losses or {}) for p, n in zip(plans, replicas, strict=True)]


def loss_key(variant: str, level: str) -> str:
    """The key of status_entries' `losses`: a level, or a variant (whose level is not kvpilot's,
    so its loss is its own)."""
    return f"variant:{variant}" if variant else level


def _entry(p: NodePlan, replicas: int, losses: Mapping[str, float]) -> PlanEntry:
    est = p.estimate
    gib = {
        key: round(memory.gib(getattr(est, attr)), 2) if est else 0.0 for key, attr in _GIB_FIELDS
    }
    return PlanEntry.model_validate(
        {
            "nodeType": p.node_type.name,
            "fits": p.fits,
            "quantization": p.quantization if p.fits else "",
            "tensorParallel": p.tensor_parallel if p.fits else 0,
            **gib,
            "maxConcurrency": p.max_concurrency,
            "pricePerHour": round(p.price_per_replica_hour, 4) if p.fits else 0.0,
            "replicas": replicas,
            "variant": p.variant,
            "qualityLoss": losses.get(loss_key(p.variant, p.quantization)) if p.fits else None,
            "reason": p.choice if p.fits else p.reason,
        }
    )
