"""Which replica serves a request: pure functions of the replicas' names, their loads and a key.

`prefix` is consistent hashing with bounded loads (CHWBL, Mirrokni et al. 2016, as KubeAI routes):
each replica owns points on a hash ring built from its name alone, so every gateway replica maps a
prompt prefix to the same replica without shared state, and a replica's prefix cache sees all of a
tenant's traffic. Two bounds refine the walk from the key's point:
- live keys: a replica serving more than `key_factor` x the mean count of live prefixes is passed
  over for a key it does not hold (routing/affinity.py: a few hot prefixes land unevenly by chance,
  and a prefix cache holds whole prefixes), and a key this gateway placed goes back to its replica;
- load: a replica is taken only while its load is under `load_factor` x the mean (counting the new
  request). A replica's load is the gateway's own in-flight requests to it (exact, current) plus
  the other gateway replicas' (the running and waiting requests it last reported on /metrics, less
  ours it counted then); one whose KV cache is nearly full is passed over while another can take
  the request.
`random` is what a Service does; `least-load` picks the least loaded replica; both are for
comparison.
"""

from __future__ import annotations

import hashlib
import math
import random as random_module
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from kvpilot.gateway.routing.affinity import Placement
from kvpilot.gateway.routing.routes import Backend

STRATEGIES = ("prefix", "least-load", "random")
POINTS_PER_REPLICA = 160  # virtual nodes: the spread of keys per replica stays within a few %


@dataclass(frozen=True)
class ReplicaLoad:
    in_flight: int = 0  # this gateway's requests now at the replica (exact, current)
    others: float = 0.0  # other gateways' requests there, as of the replica's last report
    kv_usage: float = 0.0  # 0-1 (vllm:kv_cache_usage_perc)

    @property
    def total(self) -> float:
        # Ours now plus the others' as last reported: a report seconds old must not pin a
        # replica at the load it had then (a stale peak would push every tenant off it until
        # the next scrape), and ours must not count twice.
        return self.in_flight + self.others


@dataclass(frozen=True)
class PickPolicy:
    strategy: str = "prefix"
    load_factor: float = 1.75  # lower spills so often with two replicas that caches thrash
    kv_hot: float = 0.95  # KV usage at which a replica counts as hot
    key_factor: float = 1.1  # cap on a replica's live prefixes for a new key, times the mean
    # Prefer the replicas that hold a request's LoRA adapter (lora_affinity); off: an adapter's
    # request is picked as any model's (for comparison: bench/lora_placement.py)
    lora_affinity: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; use one of {STRATEGIES}")
        if self.load_factor < 1:
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor}")
        if self.key_factor < 1:
            raise ValueError(f"key_factor must be >= 1, got {self.key_factor}")


def pick(
    policy: PickPolicy,
    key: str,
    backends: Sequence[Backend],
    loads: Mapping[str, ReplicaLoad],
    rng: random_module.Random | None = None,
    placement: Placement | None = None,
) -> Backend | None:
    """The replica for a request keyed `key` among `backends` (None when there is none)."""
    if not backends:
        return None
    load = {b.name: loads.get(b.name, ReplicaLoad()) for b in backends}
    if policy.strategy == "random":
        return (rng or random_module).choice(list(backends))
    if policy.strategy == "least-load":
        return least_loaded(backends, load, rng)
    return bounded_ring_pick(key, backends, load, policy, placement or Placement())


def least_loaded(
    backends: Sequence[Backend], load: Mapping[str, ReplicaLoad], rng: random_module.Random | None
) -> Backend:
    lowest = min(load[b.name].total for b in backends)
    ties = [b for b in backends if load[b.name].total == lowest]
    return (rng or random_module).choice(ties)


def bounded_ring_pick(
    key: str,
    backends: Sequence[Backend],
    load: Mapping[str, ReplicaLoad],
    policy: PickPolicy,
    placement: Placement,
) -> Backend:
    by_name = {b.name: b for b in backends}
    order = affinity_order(ring_order(key, tuple(sorted(by_name))), placement, policy.key_factor)
    bound = load_bound([load[name].total for name in order], policy.load_factor)
    cool = [name for name in order if load[name].kv_usage < policy.kv_hot] or list(order)
    for name in cool:
        if load[name].total + 1 <= bound:
            return by_name[name]
    # Every cool replica is over the bound (the hot ones carried little): the least loaded cool one.
    return by_name[min(cool, key=lambda name: load[name].total)]


def affinity_order(ring_walk: list[str], placement: Placement, key_factor: float) -> list[str]:
    """The ring walk with the replicas whose live keys are within the bound first (the key's own
    replica first of them), then those over it; each group in ring order. The key's own count is
    left out, so a known key stays where it is while its replica is within the bound, and moves
    when the replica is over it (more keys than its share after a scale-up)."""
    keys = dict(placement.keys)
    owner = placement.owner
    if owner is not None and owner in ring_walk:
        keys[owner] = keys.get(owner, 1) - 1
        ring_walk = [owner, *(name for name in ring_walk if name != owner)]
    bound = load_bound([keys.get(name, 0) for name in ring_walk], key_factor)
    within = [name for name in ring_walk if keys.get(name, 0) + 1 <= bound]
    return within + [name for name in ring_walk if name not in within]


def home(key: str, replicas: Sequence[str], placement: Placement, key_factor: float) -> str:
    """The replica a key belongs to among `replicas` (the route's, tried or not), load aside."""
    return affinity_order(ring_order(key, tuple(sorted(replicas))), placement, key_factor)[0]


def load_bound(loads: Sequence[float], load_factor: float) -> float:
    """The most load a replica may carry after taking one more request: the mean with it, times
    the factor, rounded up (so at least one replica is always under it)."""
    mean = (sum(loads) + 1) / len(loads)
    return math.ceil(mean * load_factor)


def ring_order(key: str, names: tuple[str, ...]) -> list[str]:
    """The replicas in the order met walking the ring clockwise from `key`'s point."""
    points, owners = ring(names)
    start = bisect_left(points, hash64(key))
    order: list[str] = []
    for index in range(start, start + len(points)):
        owner = owners[index % len(points)]
        if owner not in order:
            order.append(owner)
            if len(order) == len(names):
                break
    return order


@lru_cache(maxsize=256)
def ring(names: tuple[str, ...]) -> tuple[list[int], list[str]]:
    """Sorted ring points and their owners; cached per replica set (it changes rarely)."""
    placed = sorted(
        (hash64(f"{name}#{i}"), name) for name in names for i in range(POINTS_PER_REPLICA)
    )
    return [p for p, _ in placed], [n for _, n in placed]


def hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
