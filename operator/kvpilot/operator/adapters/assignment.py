"""How many ready pods hold each LoRA adapter, and which: from each adapter's demand. Pure.

A pod batches only `--max-loras` adapters at once and keeps `--max-cpu-loras` in host memory
(the rest are read from disk again on use), so an adapter on every pod makes every pod swap
between all of them. Instead, as S-LoRA's cluster placement argues, each adapter gets as many
copies as its share of the requests needs:

- copies = ceil(share x pods x SPREAD), at least 1, at most every pod: with SPREAD 2 each copy
  carries at most half a mean pod's load, so the gateway's load bound has holders to balance
  over; an adapter with about half the traffic or more is on every pod, a cold one on one.
- Within the slots: the copies of all adapters fit `pods x slots` (slots = --max-cpu-loras);
  past it the copy that loses least (the lowest share per remaining copy) goes first. Every
  adapter keeps one copy even past the slots (the runtime then re-reads evicted ones on use).
- Stable: a count stays while it lies between what the share needs and what 1 + BAND times the
  share needs (a rise adds copies at once, a fall removes them only once it is clear), and an
  adapter stays on the pods that hold it; new copies go to the pod with the least planned
  demand, then the fewest adapters (which spreads cold adapters evenly).
- Before any traffic (no demand at all) every adapter counts as equally hot.

Demand is each adapter's requests (metric_names.LORA_REQUESTS_RECEIVED summed over the pods);
only the shares matter, so a cumulative count and a rate plan alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

SPREAD = 2.0
BAND = 0.5

Plan = dict[str, set[str]]  # pod -> the adapters it should hold


def shares(adapters: Sequence[str], demand: Mapping[str, float]) -> dict[str, float]:
    """Each adapter's share of the requests (0..1); equal shares when none was asked for."""
    counts = {name: max(0.0, demand.get(name, 0.0)) for name in adapters}
    total = sum(counts.values())
    if total <= 0:
        return {name: 1.0 / len(adapters) for name in adapters}
    return {name: count / total for name, count in counts.items()}


def copies_for(share: float, num_pods: int) -> int:
    """The pods an adapter with this share of the requests needs, 1..num_pods."""
    needed = math.ceil(round(share * num_pods * SPREAD, 9))
    return min(num_pods, max(1, needed))


def num_copies(share: float, num_pods: int, current: int) -> int:
    """copies_for with hysteresis: `current` stays while it is within the band."""
    low = copies_for(share, num_pods)
    high = copies_for(share * (1 + BAND), num_pods)
    return min(max(current, low), high)


def fit_slots(
    copies: Mapping[str, int], share: Mapping[str, float], capacity: int
) -> dict[str, int]:
    """The copies cut to `capacity` in all, the cheapest copy first; never below one each."""
    fitted = dict(copies)
    while sum(fitted.values()) > capacity:
        extra = [name for name, n in fitted.items() if n > 1]
        if not extra:
            break
        cheapest = min(extra, key=lambda name: (share[name] / (fitted[name] - 1), name))
        fitted[cheapest] -= 1
    return fitted


def plan(
    adapters: Sequence[str],
    demand: Mapping[str, float],
    held: Mapping[str, set[str]],
    slots: int,
) -> Plan:
    """pod -> adapters, for the pods of `held` (pod -> the adapters it holds now)."""
    pods = sorted(held)
    if not pods or not adapters:
        return {pod: set() for pod in pods}
    share = shares(adapters, demand)
    current = {name: sum(name in held[pod] for pod in pods) for name in adapters}
    copies = {name: num_copies(share[name], len(pods), current[name]) for name in adapters}
    copies = fit_slots(copies, share, len(pods) * slots)
    hottest_first = sorted(adapters, key=lambda name: (-share[name], name))
    return assign(hottest_first, copies, share, held, slots)


def assign(
    order: Sequence[str],
    copies: Mapping[str, int],
    share: Mapping[str, float],
    held: Mapping[str, set[str]],
    slots: int,
) -> Plan:
    """The adapters, hottest first (a hot adapter's copies before a cold one's slot), onto the
    pods: first where they are, then where there is room and the least demand."""
    result: Plan = {pod: set() for pod in held}
    load = dict.fromkeys(held, 0.0)

    def rank(pod: str) -> tuple[float, int, str]:
        return load[pod], len(result[pod]), pod

    def has_room(pod: str) -> bool:
        return len(result[pod]) < slots

    for name in order:
        holders = sorted((p for p in held if name in held[p] and has_room(p)), key=rank)
        chosen = holders[: copies[name]]
        while len(chosen) < copies[name]:
            others = [p for p in result if p not in chosen]
            free = [p for p in others if has_room(p)]
            if not free and chosen:
                break  # out of slots: fewer copies
            chosen.append(min(free or others, key=rank))  # one copy even past the slots
        for pod in chosen:
            result[pod].add(name)
            load[pod] += share[name] / copies[name]
    return result
