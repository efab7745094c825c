"""Which evicted KV blocks a tier keeps, and which it lets go (pure Python, no tensors).

A tier is worth its copies only when blocks come back. So a tier with room takes every block it
is offered (room costs nothing), but a full tier takes a block only when reuse is likely: the
block was hit at least once while it was cached above, or it was offered and refused before (a
second sighting: its hash sits in a bounded ghost list). A workload in which nothing repeats
thus stops paying for copies once the tier is full.

Eviction is a segmented LRU, frequency-aware: entries that were never hit here wait on
probation and go first; an entry hit here moves to the protected segment, which holds at most
PROTECTED_FRACTION of the capacity (its least recent entry drops back to probation), so a burst
of hits cannot pin the tier forever.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
PROTECTED_FRACTION = 0.8


@dataclass
class Entry(Generic[T]):
    value: T
    num_hits: int  # hits above (in the pool) and here


@dataclass(frozen=True)
class Victim(Generic[T]):
    hash: int
    value: T
    num_hits: int


class TierIndex(Generic[T]):
    """hash -> value for up to `capacity` blocks, admission and eviction as the module says."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a tier must hold at least one block, got capacity {capacity}")
        self.capacity = capacity
        self.max_protected = max(1, int(capacity * PROTECTED_FRACTION))
        self.probation: OrderedDict[int, Entry[T]] = OrderedDict()  # least recent first
        self.protected: OrderedDict[int, Entry[T]] = OrderedDict()
        self.ghosts: OrderedDict[int, None] = OrderedDict()  # refused once, at most `capacity`

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.probation or block_hash in self.protected

    def get(self, block_hash: int) -> T | None:
        """The value, counting a hit: the entry becomes the most recent protected one."""
        entry = self.probation.pop(block_hash, None) or self.protected.pop(block_hash, None)
        if entry is None:
            return None
        entry.num_hits += 1
        self.protected[block_hash] = entry
        self._demote_overflow()
        return entry.value

    def should_admit(self, block_hash: int, num_hits: int) -> bool:
        """Whether to copy the block in at all; a refusal is remembered as a ghost."""
        if block_hash in self:
            return False
        if len(self) < self.capacity or num_hits > 0 or block_hash in self.ghosts:
            self.ghosts.pop(block_hash, None)
            return True
        self.ghosts[block_hash] = None
        if len(self.ghosts) > self.capacity:
            self.ghosts.popitem(last=False)
        return False

    def put(self, block_hash: int, value: T, num_hits: int) -> list[Victim[T]]:
        """Insert (a block with hits goes straight to protected); the entries evicted."""
        segment = self.protected if num_hits > 0 else self.probation
        segment[block_hash] = Entry(value, num_hits)
        self._demote_overflow()
        victims: list[Victim[T]] = []
        while len(self) > self.capacity:
            victims.append(self._evict())
        return victims

    def pop(self, block_hash: int) -> T | None:
        entry = self.probation.pop(block_hash, None) or self.protected.pop(block_hash, None)
        return None if entry is None else entry.value

    def _evict(self) -> Victim[T]:
        segment = self.probation if self.probation else self.protected
        block_hash, entry = segment.popitem(last=False)
        return Victim(block_hash, entry.value, entry.num_hits)

    def _demote_overflow(self) -> None:
        while len(self.protected) > self.max_protected:
            block_hash, entry = self.protected.popitem(last=False)
            self.probation[block_hash] = entry
