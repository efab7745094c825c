"""Which replica each live prompt prefix was sent to, as this gateway saw it.

Consistent hashing spreads many keys evenly but a few by chance: 16 tenants over two replicas
split 13/3 in bench.gateway_routing, and the replica with 13 could not keep their prefixes in its
KV pool (prefix-cache hit rate 75% where one replica with both pools reached 95%). A replica's
prefix cache holds whole prefixes, so what must be spread is the number of distinct prefixes each
replica serves, not only the requests in flight. This book remembers each key's replica while
the key is in use and counts the live keys per replica; routing/picking.py sends a key back to its
replica while that replica's count is within the bound, and otherwise (a new key, a replica gone
or over the bound after a scale-up) to the first replica on its ring walk within the bound.

Each gateway replica keeps its own book (no shared state): two of them agree on every key the
ring places within the bound, and may place a key that overflows its ring replica differently.
A key idle for `idle_s` is forgotten (the replica's cache will have evicted it by then).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Placement:
    """What the book knows for one request: the key's replica, and live keys per replica."""

    owner: str | None = None
    keys: dict[str, int] = field(default_factory=dict)


class Affinity:
    def __init__(
        self,
        idle_s: float = 600.0,
        max_keys: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle_s, self.max_keys, self.clock = idle_s, max_keys, clock
        self._owners: OrderedDict[str, tuple[str, float]] = OrderedDict()  # least recent first
        self._counts: Counter[str] = Counter()

    def placement(self, key: str) -> Placement:
        self._forget_idle()
        owner = self._owners.get(key)
        return Placement(owner[0] if owner else None, dict(self._counts))

    def settle(self, key: str, replica: str) -> None:
        """Record `replica` as the key's home (picking.home: where it goes unless the load bound
        sends one request elsewhere)."""
        owner = self._owners.get(key)
        if owner:
            self._uncount(owner[0])
        self._owners[key] = (replica, self.clock())
        self._owners.move_to_end(key)
        self._counts[replica] += 1
        while len(self._owners) > self.max_keys:
            self._drop_oldest()

    def _forget_idle(self) -> None:
        cutoff = self.clock() - self.idle_s
        while self._owners and next(iter(self._owners.values()))[1] < cutoff:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, (replica, _) = self._owners.popitem(last=False)
        self._uncount(replica)

    def _uncount(self, replica: str) -> None:
        self._counts[replica] -= 1
        if self._counts[replica] <= 0:
            del self._counts[replica]
