"""What is done with the planner's verdicts (NodePlan, one per node type): ordered by the spec's
`prefer` (quality, or cost per request, measured where it was), replicas spread over the fitting
ones, and the status.plan entries written from them. Pure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.contract import memory
from kvpilot.contract.checkpoint_quant import SIXTEEN_BIT
from kvpilot.contract.memory import MemoryEstimate
from kvpilot.operator.api import PlanEntry
from kvpilot.operator.autoscaling.spread import spread_replicas
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.planning.request import PlanRequest, rank_level

_GIB_FIELDS = (
    ("weightsGiB", "weights_bytes"),
    ("kvCacheGiB", "kv_cache_bytes"),
    ("overheadGiB", "overhead_bytes"),
    ("usableGiB", "usable_bytes"),
)


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
