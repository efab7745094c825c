"""Block manager: prefix caching behaviour (tables) and invariants under any operation sequence."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.block_manager import NO_HASH, BlockManager, TierLookup
from kvpilot.runtime.engine.sequence import Sequence


def make_seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(tokens))


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Admit a whole prompt as the scheduler does; returns the number of cached tokens."""
    cached = bm.find_cached_blocks(seq)
    num_new = seq.num_tokens - len(cached) * BLOCK_SIZE
    bm.allocate_slots(seq, num_new, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return len(cached) * BLOCK_SIZE


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    refs: dict[int, int] = {}
    for seq in live:
        for block_id in seq.block_table:
            refs[block_id] = refs.get(block_id, 0) + 1
    assert bm.num_free_blocks + len(refs) == bm.num_total_blocks
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0)
        assert (block.block_id in bm.free_queue) == (block.ref_count == 0)
    for block_hash, block_id in bm.hash_to_block.items():
        assert bm.blocks[block_id].hash == block_hash
    if bm.is_prefix_caching:  # every computed full block is hashed, so later requests can hit it
        for seq in live:
            num_full = min(seq.num_computed_tokens // BLOCK_SIZE, len(seq.block_table))
            hashes = [bm.blocks[b].hash for b in seq.block_table[:num_full]]
            assert NO_HASH not in hashes


@pytest.mark.parametrize(
    ("first", "second", "expected_cached"),
    [
        (list(range(40)), list(range(40)), 32),  # same prompt: full blocks, last token recomputed
        (list(range(32)), list(range(32)), 16),  # exactly 2 blocks: keep one token to compute
        (list(range(40)), list(range(16)) + [999] * 24, 16),  # diverges in the second block
        (list(range(40)), [7, *range(1, 40)], 0),  # diverges in the first token
        (list(range(10)), list(range(10)), 0),  # no full block, nothing to share
    ],
)
def test_prefix_hits(first: list[int], second: list[int], expected_cached: int) -> None:
    bm = BlockManager(16)
    admit(bm, make_seq(first, "a"))
    assert admit(bm, make_seq(second, "b")) == expected_cached


def test_freed_hashed_blocks_are_reused_until_evicted() -> None:
    bm = BlockManager(4)
    a = make_seq(list(range(33)), "a")
    admit(bm, a)  # 3 blocks, 2 of them full and hashed
    bm.free(a)
    assert bm.num_free_blocks == 4
    assert admit(bm, make_seq(list(range(33)), "b")) == 32  # hit on freed blocks
    bm2 = BlockManager(4)
    c = make_seq(list(range(33)), "c")
    admit(bm2, c)
    bm2.free(c)
    admit(bm2, make_seq([5] * 64, "d"))  # takes all 4 blocks: evicts the cached prefix
    assert bm2.find_cached_blocks(make_seq(list(range(33)), "e")) == []


def test_free_queue_evicts_unhashed_then_tail_blocks_first() -> None:
    bm = BlockManager(8)
    seq = make_seq(list(range(40)), "a")  # blocks: full, full, partial
    admit(bm, seq)
    table = list(seq.block_table)
    bm.free(seq)
    order = list(bm.free_queue)
    assert order.index(table[2]) < order.index(table[1]) < order.index(table[0])


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(8, enable_prefix_caching=False)
    admit(bm, make_seq(list(range(40)), "a"))
    assert admit(bm, make_seq(list(range(40)), "b")) == 0
    assert all(b.hash == NO_HASH for b in bm.blocks)


def test_can_allocate_counts_revived_cached_blocks() -> None:
    bm = BlockManager(3)
    a = make_seq([*range(32), 1], "a")
    admit(bm, a)
    bm.free(a)
    b = make_seq(list(range(32)) + [2] * 20, "b")  # 2 cached blocks + 2 new: needs 4 > 3
    cached = bm.find_cached_blocks(b)
    assert len(cached) == 2
    assert not bm.can_allocate_slots(b, b.num_tokens - 32, cached)
    with pytest.raises(ValueError, match="not enough free KV blocks"):
        bm.allocate_slots(b, b.num_tokens - 32, cached)
    check_invariants(bm, [])


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["add", "grow", "finish", "preempt"]),
        st.integers(0, 5),  # which prompt family (shared prefixes)
        st.integers(1, 70),  # length
        st.integers(0, 10),  # which live sequence
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPERATIONS, num_blocks=st.integers(4, 24), caching=st.booleans())
def test_invariants_hold_under_any_operations(
    ops: list[tuple[str, int, int, int]], num_blocks: int, caching: bool
) -> None:
    bm = BlockManager(num_blocks, enable_prefix_caching=caching)
    live: list[Sequence] = []
    for index, (op, family, length, pick) in enumerate(ops):
        if op == "add":
            seq = make_seq([family * 1000 + i for i in range(length)], str(index))
            cached = bm.find_cached_blocks(seq)
            num_new = seq.num_tokens - len(cached) * BLOCK_SIZE
            if bm.can_allocate_slots(seq, num_new, cached):
                bm.allocate_slots(seq, num_new, cached)
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_full_blocks(seq)
                live.append(seq)
        elif live and op == "grow":  # decode one token
            seq = live[pick % len(live)]
            seq.append_token(family)
            if bm.can_allocate_slots(seq, 1):
                bm.allocate_slots(seq, 1)
                seq.num_computed_tokens += 1
                bm.cache_full_blocks(seq)
        elif live:  # finish, abort and preempt all release the blocks
            bm.free(live.pop(pick % len(live)))
        check_invariants(bm, live)
    for seq in live:
        bm.free(seq)
    check_invariants(bm, [])
    assert bm.num_free_blocks == num_blocks


class HeldBlocks:
    """The plainest lower tier: it holds whatever evicted block it is handed, by hash."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, tuple[int, ...]], str] = {}
        self.counted: list[TierLookup] = []

    def fetch(self, block_hash: int, token_ids: tuple[int, ...], lookup: TierLookup) -> str | None:
        lookup.queries["held"] += 1
        return self.held.get((block_hash, token_ids))

    def count_lookup(self, lookup: TierLookup) -> None:
        self.counted.append(lookup)


def test_evicted_prefix_blocks_are_recorded_and_come_back_as_loads() -> None:
    bm, tier = BlockManager(4), HeldBlocks()
    bm.lower = tier
    first = make_seq(list(range(40)), "a")  # 2 full blocks and a partial one
    admit(bm, first)
    hashes = [bm.blocks[b].hash for b in first.block_table[:2]]
    bm.free(first)
    other = make_seq(list(range(100, 164)), "b")  # takes all 4 blocks: evicts both
    admit(bm, other)
    evicted, loads = bm.take_transfers()
    assert [e.hash for e in evicted] == hashes[::-1] and loads == []  # the tail goes first
    assert [e.token_ids for e in evicted] == [tuple(range(16, 32)), tuple(range(16))]
    for e in evicted:
        tier.held[(e.hash, e.token_ids)] = f"kv of {e.hash}"
    bm.free(other)
    again = make_seq(list(range(40)), "c")
    assert bm.find_cached_blocks(again) == []
    lookup = bm.find_tier_blocks(again, [])
    assert [h.hash for h in lookup.hits] == hashes
    assert bm.find_tier_blocks(again, []) == lookup and tier.counted == []  # not yet admitted
    bm.record_lookup(again, 0, lookup)
    assert tier.counted == [lookup] and bm.num_lower_hit_tokens == 32
    bm.allocate_slots(again, 40 - 32, [], lookup.hits)
    assert again.num_computed_tokens == 32
    evicted, loads = bm.take_transfers()
    assert [load.payload for load in loads] == [f"kv of {h}" for h in hashes]
    assert [load.block_id for load in loads] == again.block_table[:2]
    assert [bm.blocks[b].hash for b in again.block_table[:2]] == hashes  # hashed at once
    assert len(evicted) == 3  # the other sequence's hashed blocks whose slots were taken
    check_invariants(bm, [again])


def test_block_hashes_are_pinned_values() -> None:
    """Disk tier files are found by these after a restart, maybe by another Python: BLAKE2b
    values, pinned here, not a hash() whose algorithm may change."""
    from kvpilot.runtime.engine.block_manager import block_hash

    first = block_hash(NO_HASH, tuple(range(16)))
    assert first == 0x7A5A02220B352010
    assert block_hash(first, (1,) * 16) == 0x6D2D0B7571921393
