"""Replicas per node type: the one spread function, used by the autoscaler (with running and
stuck replicas) and by reconcile (`planner.assign_replicas`, before anything runs). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def spread_replicas(
    total: int,
    node_types_in_plan_order: Sequence[str],
    free_gpus_per_type: Mapping[str, int],
    gpus_per_replica: Mapping[str, int] | int,
    current_per_type: Mapping[str, int],
    unschedulable_since: Mapping[str, float | None],
    now: float,
    spill_after_s: float,
    *,
    pending_per_type: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Replicas per node type for `total` replicas.

    Replicas that run stay where they are (moving them would restart them); a smaller total
    removes pending replicas first, then replicas of the least preferred types; a larger one
    goes to the first types in plan order whose free GPUs hold it. What fits nowhere waits on
    the first type not given up on. A type whose pods have been Unschedulable for at least
    `spill_after_s` is given up on: its pending replicas (`pending_per_type`) move on to the
    next types that fit, and it gets no new ones (taints, CPU or memory can leave a node with
    free GPUs and no room).
    """
    order = list(node_types_in_plan_order)
    _check_spread_input(total, order, gpus_per_replica)
    per_replica = _per_type(gpus_per_replica, order)
    spilled = {t for t in order if is_given_up(unschedulable_since.get(t), now, spill_after_s)}
    pending = {t: max(0, (pending_per_type or {}).get(t, 0)) for t in order}
    placed = {t: max(0, current_per_type.get(t, 0)) for t in order}
    for t in spilled:  # give up on the pods that never got GPUs there
        placed[t] -= min(placed[t], pending[t])
        pending[t] = 0
    _shrink(placed, pending, sum(placed.values()) - total, order)
    missing = total - sum(placed.values())
    for t in order:
        if t in spilled:  # the scheduler found no room there, whatever the free GPUs say
            continue
        room = max(0, free_gpus_per_type.get(t, 0) // per_replica[t] - pending[t])
        add = min(missing, room)
        placed[t] += add
        missing -= add
    if missing > 0:
        waiting_on = next((t for t in order if t not in spilled), order[0])
        placed[waiting_on] += missing
    return placed


def is_given_up(unschedulable_since: float | None, now: float, spill_after_s: float) -> bool:
    """A node type's pods have waited Unschedulable long enough to move elsewhere."""
    return unschedulable_since is not None and now - unschedulable_since >= spill_after_s


def _shrink(placed: dict[str, int], pending: dict[str, int], excess: int, order: list[str]) -> None:
    """Remove `excess` replicas in place: pending ones first, then the least preferred types."""
    for pool in (pending, placed):
        for t in reversed(order):
            take = min(max(excess, 0), pool[t], placed[t])
            placed[t] -= take
            pending[t] -= min(take, pending[t])
            excess -= take


def _check_spread_input(
    total: int, order: list[str], gpus_per_replica: Mapping[str, int] | int
) -> None:
    if total < 0:
        raise ValueError(f"total replicas must be >= 0, got {total}")
    if not order:
        raise ValueError("no node type in the plan fits this model; nothing to spread over")
    if len(set(order)) != len(order):
        raise ValueError(f"node types repeat in the plan order: {order}")
    values = [gpus_per_replica] if isinstance(gpus_per_replica, int) else gpus_per_replica.values()
    if any(v < 1 for v in values):
        raise ValueError(f"gpus per replica must be >= 1, got {gpus_per_replica}")


def _per_type(gpus_per_replica: Mapping[str, int] | int, order: list[str]) -> dict[str, int]:
    if isinstance(gpus_per_replica, int):
        return dict.fromkeys(order, gpus_per_replica)
    missing = [t for t in order if t not in gpus_per_replica]
    if missing:
        raise ValueError(f"gpus per replica unknown for node types {missing}")
    return {t: gpus_per_replica[t] for t in order}
