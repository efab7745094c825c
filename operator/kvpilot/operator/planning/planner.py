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
from collections.abc import Iterable, Sequence

from kvpilot.contract import memory
from kvpilot.contract.checkpoint_quant import SIXTEEN_BIT
from kvpilot.contract.memory import MemoryEstimate, ModelFacts
from kvpilot.operator.api import ModelDeploymentSpec
from kvpilot.operator.planning import choice
from kvpilot.operator.planning.inventory import NodeType

# The request (request.py) and what is done with the verdicts (plans.py) are the planner's API
# too: callers name them as planner.X.
from kvpilot.operator.planning.plans import (
    NodePlan,
    assign_replicas,
    cost_rank,
    estimated_cost,
    loss_key,
    order,
    status_entries,
)
from kvpilot.operator.planning.request import (
    Candidate,
    PlanRequest,
    adapter_slot_bytes,
    memory_request_bytes,
    rank_level,
    user_memory_bytes,
)

__all__ = [
    "REFERENCE_LEVELS",
    "TP_DEGREES",
    "Candidate",
    "NodePlan",
    "PlanRequest",
    "adapter_slot_bytes",
    "assign_replicas",
    "checkpoint_kind",
    "cost_rank",
    "desired_total",
    "estimated_cost",
    "loss_key",
    "memory_request_bytes",
    "order",
    "plan",
    "plan_node_type",
    "rank_level",
    "reference_plan",
    "status_entries",
    "tp_degrees",
    "user_memory_bytes",
]

TP_DEGREES = (1, 2, 4, 8)
# Largest first: an eval's reference is the first of these some node type fits (reference_plan).
REFERENCE_LEVELS = ("bf16", "int8", "int4")


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
    """A pre-quantised checkpoint splits over the GPUs that give each rank whole groups of
    o_proj's and down_proj's inputs (checkpoint_quant.check_prequantized_parallel)."""
    checkpoint = candidate.facts.checkpoint
    return checkpoint is None or tp in checkpoint.tensor_parallel_sizes


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
    checkpoints = [facts.checkpoint for _, facts in sources if facts.checkpoint is not None]
    splits = sorted({tp for checkpoint in checkpoints for tp in checkpoint.tensor_parallel_sizes})
    return (
        f"{node_type.name}: a pre-quantised checkpoint splits over {_gpus(splits)} only (each"
        " rank takes whole groups of o_proj's and down_proj's inputs), and minGpusPerReplica"
        f" is {request.min_gpus_per_replica} on nodes of {node_type.gpus_per_node} GPU(s)"
    )


def _gpus(counts: list[int]) -> str:
    words = [str(n) for n in counts]
    joined = ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else "".join(words)
    return f"{joined} GPU{'s' if counts != [1] else ''}"


def checkpoint_kind(facts: ModelFacts) -> str:
    """How the checkpoint stores its weights, as the runtime's --expect-checkpoint names it."""
    return SIXTEEN_BIT if facts.checkpoint is None else facts.checkpoint.kind


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


def tp_degrees(request: PlanRequest, node_type: NodeType) -> list[int]:
    """Tensor-parallel degrees to try: within the GPUs per node and the spec's bounds, and only
    those that split the KV heads evenly (the runtime refuses any other). A draft model runs
    whole on GPU 0 beside its shard (memory.estimate counts it there). With KV tiers only 1: the
    runtime does not run them under tensor parallelism (a pre-quantised checkpoint's own degrees:
    `_runs`)."""
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
