"""n > 1 choices of one prompt: the later ones (followers) wait until the first (their leader) has
its prompt in the prefix cache, then read it from there rather than computing it again."""

from __future__ import annotations

from collections.abc import Mapping

from kvpilot.runtime.engine.output_processor import RequestState
from kvpilot.runtime.engine.sequence import Sequence


class PromptFollowers:
    """Followers held by their leader's request id; the engine's step thread only."""

    def __init__(self) -> None:
        self._by_leader: dict[str, list[Sequence]] = {}

    def hold(self, leader_id: str, seq: Sequence) -> None:
        self._by_leader.setdefault(leader_id, []).append(seq)

    def release(self, states: Mapping[str, RequestState]) -> list[Sequence]:
        """The followers whose leader has its first token (so its prompt blocks are cached) or
        is gone (aborted, finished), to queue up first in line: last first, so they run as they
        arrived. An aborted follower is already answered, so it is left out."""
        released: list[Sequence] = []
        for leader_id in list(self._by_leader):
            leader = states.get(leader_id)
            if leader is not None and leader.seq.num_output_tokens == 0:
                continue
            followers = reversed(self._by_leader.pop(leader_id))
            released += [seq for seq in followers if not seq.is_finished]
        return released
