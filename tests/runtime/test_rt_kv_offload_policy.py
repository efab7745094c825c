"""KV tier index (engine/kv_offload_policy.py): admission by reuse, frequency-aware eviction."""

from __future__ import annotations

import pytest

from kvpilot.runtime.engine.kv_offload_policy import TierIndex


def filled(capacity: int, hashes: list[int], hits: int = 0) -> TierIndex[str]:
    index: TierIndex[str] = TierIndex(capacity)
    for block_hash in hashes:
        assert index.should_admit(block_hash, hits)
        index.put(block_hash, f"v{block_hash}", hits)
    return index


@pytest.mark.parametrize(
    ("held", "offered", "num_hits", "offered_before", "admitted"),
    [
        ([1], 2, 0, False, True),  # room: anything is taken
        ([1, 2], 3, 0, False, False),  # full, first sighting, never hit: refused
        ([1, 2], 3, 1, False, True),  # full, but hit while in the pool: likely reused
        ([1, 2], 3, 0, True, True),  # full, refused once before: second sighting
        ([1, 2], 2, 5, False, False),  # already held: no second copy
    ],
)
def test_admission(
    held: list[int], offered: int, num_hits: int, offered_before: bool, admitted: bool
) -> None:
    index = filled(2, held)
    if offered_before:
        assert not index.should_admit(offered, 0)
    assert index.should_admit(offered, num_hits) is admitted


def test_ghosts_are_bounded_by_the_capacity() -> None:
    index = filled(2, [1, 2])
    for block_hash in range(10, 15):
        assert not index.should_admit(block_hash, 0)
    assert list(index.ghosts) == [13, 14]  # the oldest refusals forgotten
    assert not index.should_admit(10, 0)  # forgotten: a first sighting again


@pytest.mark.parametrize(
    ("hits_on", "insert", "insert_hits", "evicted"),
    [
        ([], 4, 0, [1]),  # plain LRU among blocks never hit
        ([1], 4, 0, [2]),  # a hit protects: the least recent unhit block goes
        ([1, 2, 3], 4, 0, [1]),  # protected holds 2 of 3: the least recently hit is demoted
        ([1, 2], 4, 1, [3]),  # a block hit above enters protected; probation goes first
    ],
)
def test_eviction_prefers_blocks_never_hit(
    hits_on: list[int], insert: int, insert_hits: int, evicted: list[int]
) -> None:
    index = filled(3, [1, 2, 3])
    for block_hash in hits_on:
        assert index.get(block_hash) == f"v{block_hash}"
    victims = index.put(insert, f"v{insert}", insert_hits)
    assert [v.hash for v in victims] == evicted
    assert len(index) == 3


def test_protected_segment_is_capped_so_old_hits_age_out() -> None:
    index = filled(5, [1, 2, 3, 4, 5])  # protected holds at most 4 (80%)
    for block_hash in (1, 2, 3, 4, 5):
        index.get(block_hash)
    assert list(index.protected) == [2, 3, 4, 5]
    assert list(index.probation) == [1]  # demoted, least recently hit
    assert [v.hash for v in index.put(6, "v6", 1)] == [1]


def test_get_counts_hits_and_pop_removes() -> None:
    index = filled(2, [1])
    assert index.get(9) is None
    index.get(1)
    index.get(1)
    assert index.protected[1].num_hits == 2
    assert index.pop(1) == "v1" and 1 not in index and index.pop(1) is None


def test_a_tier_without_room_for_a_block_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        TierIndex(0)
