"""The scheduler's waiting queue, one per `--scheduling-policy` (pure Python).

fcfs: arrival order, with a preempted sequence (or a prompt follower) put back at the front.
priority: ordered by (priority, arrival), lower first (vLLM's semantics), in a heap, so a step's
admission costs O(log n) in the queue's length rather than a sort. A preempted sequence keeps
its arrival, so it goes back to exactly the place it had: ahead of later requests of its
priority, behind every better one.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from kvpilot.contract.engine_config import SCHEDULING_POLICY_CHOICES
from kvpilot.runtime.engine.sequence import Sequence


def check_priority(priority: int, policy: str) -> None:
    """vLLM's rule: a priority other than 0 needs the priority policy, rather than being
    silently ignored under fcfs."""
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority: {priority} needs a server started with --scheduling-policy priority "
            f"(this one schedules {policy}); send priority 0 or leave it out"
        )


def rank(seq: Sequence) -> tuple[int, int]:
    """Who goes first: the lower priority value, then the earlier arrival (unique, so ranks
    never tie)."""
    return seq.priority, seq.arrival


class WaitingQueue(Protocol):
    def push(self, seq: Sequence, at_front: bool = False) -> None: ...
    def peek(self) -> Sequence: ...
    def pop(self) -> Sequence: ...
    def remove(self, seq: Sequence) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Sequence]: ...


class FcfsQueue:
    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def push(self, seq: Sequence, at_front: bool = False) -> None:
        if at_front:
            self._queue.appendleft(seq)
        else:
            self._queue.append(seq)

    def peek(self) -> Sequence:
        return self._queue[0]

    def pop(self) -> Sequence:
        return self._queue.popleft()

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)


class PriorityQueue:
    """A heap of (priority, arrival, sequence); `at_front` is not needed: the rank alone puts a
    preempted sequence back where it was."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Sequence]] = []

    def push(self, seq: Sequence, at_front: bool = False) -> None:
        heapq.heappush(self._heap, (*rank(seq), seq))

    def peek(self) -> Sequence:
        return self._heap[0][2]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[2]

    def remove(self, seq: Sequence) -> None:
        """O(n), as deque.remove: only an abort of a waiting sequence comes here."""
        self._heap = [entry for entry in self._heap if entry[2] is not seq]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        """In no particular order (the heap's)."""
        return (entry[2] for entry in self._heap)


def make_waiting_queue(policy: str) -> WaitingQueue:
    if policy == "fcfs":
        return FcfsQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(
        f"scheduling policy must be one of {', '.join(SCHEDULING_POLICY_CHOICES)}, got {policy!r}"
    )
