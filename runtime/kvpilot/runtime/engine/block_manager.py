"""Paged KV-cache bookkeeping with prefix caching (pure Python; nano-vllm / vLLM v1 style).

A block holds BLOCK_SIZE tokens. A block whose tokens are all computed gets a hash chained from its
parent's, so equal hashes mean equal prefixes. Blocks are ref-counted and shared between sequences
with a common prefix. A freed hashed block keeps its hash in the free queue and is reused on a hit
until it is evicted: the free queue is LRU, and blocks without a hash are handed out first.

With a lower tier (engine/kv_offload.py) an evicted hashed block is recorded in `evicted`, for the
engine to copy out before the step that reuses its slot runs; a prefix that misses the pool but
hits the tier takes fresh blocks, hashed at once, whose KV the engine copies in (`loads`) before
the step that reads them runs.

Check/act pairs: `can_allocate_slots` / `allocate_slots`.
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.sequence import Sequence

NO_HASH = -1


def block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained 64-bit hash of a full block. BLAKE2b of the bytes rather than Python's hash(),
    so that it is the same in every process and Python version: a disk tier's files are found
    by it after a restart."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update((parent_hash & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little"))
    digest.update(array("I", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


# Adapter ids count loads in this process only: a root drawn at random per process keeps an
# adapter's blocks, written to a disk tier (engine/kv_offload.py), from ever matching another
# adapter's after a restart (the base model's chains, from NO_HASH, are the same in every process).
_LORA_ROOT_SALT = secrets.randbits(64)


def root_hash(seq: Sequence) -> int:
    """The parent of a sequence's first block: the KV of a prefix depends on the LoRA adapter
    it was computed under, so each adapter's chain starts from its own root and a prefix
    computed under adapter A is never served to B or to the base model."""
    if seq.lora_id == 0:
        return NO_HASH
    return block_hash(_LORA_ROOT_SALT, (seq.lora_id,))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: tuple[int, ...] = field(default_factory=tuple)
    num_hits: int = 0  # prefix-cache hits since it was hashed: the tiers admit by reuse


class LowerTier(Protocol):
    """Where evicted blocks go (engine/kv_offload.py), as the block manager looks them up."""

    def fetch(
        self, block_hash: int, token_ids: tuple[int, ...], lookup: TierLookup
    ) -> object | None:
        """The block's KV (opaque here) when the tier holds it, else None; the tiers asked,
        and the one that answered, are noted in `lookup`."""
        ...

    def count_lookup(self, lookup: TierLookup) -> None:
        """Add an admitted sequence's look-up to the tiers' counters."""
        ...


@dataclass(frozen=True)
class EvictedBlock:
    """A hashed block whose slot is about to be reused: its KV is still in the pool."""

    block_id: int
    hash: int
    token_ids: tuple[int, ...]
    num_hits: int


@dataclass(frozen=True)
class BlockLoad:
    """A fresh block that a lower tier's copy of its KV (`payload`) must fill before a step."""

    block_id: int
    payload: object


@dataclass(frozen=True)
class TierHit:
    hash: int
    token_ids: tuple[int, ...]
    payload: object


@dataclass
class TierLookup:
    """One waiting sequence's look-up below the pool: the blocks found, in order, and per tier
    the blocks asked for and those answered. A sequence is looked up at each try to schedule
    it; its look-up is counted once, when it is admitted (as vLLM counts prefix-cache tokens)."""

    hits: list[TierHit] = field(default_factory=list)
    queries: Counter[str] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)


class BlockManager:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.is_prefix_caching = enable_prefix_caching
        self.hash_to_block: dict[int, int] = {}
        # Free blocks in eviction order (front first); values unused.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.num_queried_tokens = 0  # prefix-cache lookups, in tokens, cumulative
        self.num_hit_tokens = 0
        self.lower: LowerTier | None = None  # set by the engine when tiers are on
        self.evicted: list[EvictedBlock] = []  # since the engine last took them
        self.loads: list[BlockLoad] = []
        self.num_lower_queried_tokens = 0  # tokens looked up in the tiers after a pool miss
        self.num_lower_hit_tokens = 0

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks

    # -- prefix cache lookup --------------------------------------------------------------------

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Block ids holding a prefix of `seq`. At least one token is left to compute, because
        the model must run on the last token to produce the next one."""
        if not self.is_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // BLOCK_SIZE
        found: list[int] = []
        parent = root_hash(seq)
        for index in range(max_blocks):
            tokens = tuple(seq.token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
            parent = block_hash(parent, tokens)
            block_id = self.hash_to_block.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
        return found

    def find_tier_blocks(self, seq: Sequence, cached: list[int]) -> TierLookup:
        """The blocks of `seq` after its pool hits `cached` that the lower tier holds, in
        order up to the first it lacks (the same at-least-one-token-left rule)."""
        lookup = TierLookup()
        if self.lower is None or not self.is_prefix_caching:
            return lookup
        max_blocks = (seq.num_tokens - 1) // BLOCK_SIZE
        parent = self.blocks[cached[-1]].hash if cached else NO_HASH
        for index in range(len(cached), max_blocks):
            tokens = tuple(seq.token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
            parent = block_hash(parent, tokens)
            payload = self.lower.fetch(parent, tokens, lookup)
            if payload is None:
                break
            lookup.hits.append(TierHit(parent, tokens, payload))
        return lookup

    def record_lookup(
        self, seq: Sequence, num_hit_tokens: int, lookup: TierLookup | None = None
    ) -> None:
        """Count an admitted sequence's look-ups: in the pool, and (`lookup`) in the tiers."""
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += num_hit_tokens
        if self.lower is not None:
            self.num_lower_queried_tokens += seq.num_tokens - num_hit_tokens
            if lookup is not None:
                self.num_lower_hit_tokens += len(lookup.hits) * BLOCK_SIZE
                self.lower.count_lookup(lookup)

    def take_transfers(self) -> tuple[list[EvictedBlock], list[BlockLoad]]:
        """The copies the next step needs first: out of evicted slots, then into loaded ones."""
        evicted, loads = self.evicted, self.loads
        self.evicted, self.loads = [], []
        return evicted, loads

    # -- allocation -----------------------------------------------------------------------------

    def num_blocks_needed(
        self, seq: Sequence, num_new_tokens: int, cached: list[int], num_loaded: int = 0
    ) -> int:
        """Free-queue blocks that admitting `num_new_tokens` more tokens would take, counting
        cached hits that sit in the free queue (taking them removes them from it) and fresh
        blocks for the `num_loaded` blocks a lower tier fills."""
        num_prefix = (len(cached) + num_loaded) * BLOCK_SIZE
        num_computed = max(seq.num_computed_tokens, num_prefix)
        num_blocks_after = -(-(num_computed + num_new_tokens) // BLOCK_SIZE)
        num_fresh = max(0, num_blocks_after - len(seq.block_table) - len(cached))
        num_revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return num_fresh + num_revived

    def can_allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached: list[int] | None = None,
        num_loaded: int = 0,
    ) -> bool:
        num_needed = self.num_blocks_needed(seq, num_new_tokens, cached or [], num_loaded)
        return num_needed <= self.num_free_blocks

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached: list[int] | None = None,
        tier_hits: list[TierHit] | None = None,
    ) -> None:
        """Attach cached prefix blocks and blocks to load from a lower tier (first admission)
        and grow the block table to hold num_computed_tokens + num_new_tokens tokens."""
        cached, tier_hits = cached or [], tier_hits or []
        if not self.can_allocate_slots(seq, num_new_tokens, cached, len(tier_hits)):
            raise ValueError(f"not enough free KV blocks for {num_new_tokens} tokens")
        for block_id in cached:
            self._take(block_id)
            self.blocks[block_id].num_hits += 1
            seq.block_table.append(block_id)
        for hit in tier_hits:
            seq.block_table.append(self._take_loaded(hit))
        if cached or tier_hits:
            seq.num_computed_tokens = (len(cached) + len(tier_hits)) * BLOCK_SIZE
        num_blocks_after = -(-(seq.num_computed_tokens + num_new_tokens) // BLOCK_SIZE)
        while len(seq.block_table) < num_blocks_after:
            seq.block_table.append(self._take_fresh())

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # evicted: its prefix is no longer cached
            if self.lower is not None:
                self.evicted.append(
                    EvictedBlock(block_id, block.hash, block.token_ids, block.num_hits)
                )
        block.hash, block.token_ids, block.ref_count, block.num_hits = NO_HASH, (), 1, 0
        return block_id

    def _take_loaded(self, hit: TierHit) -> int:
        """A fresh block for a tier hit, hashed now: its KV is copied in before the step runs,
        so a sequence scheduled later in this step may share it. A tier hit is a reuse."""
        block_id = self._take_fresh()
        block = self.blocks[block_id]
        block.hash, block.token_ids, block.num_hits = hit.hash, hit.token_ids, 1
        self.hash_to_block.setdefault(hit.hash, block_id)
        self.loads.append(BlockLoad(block_id, hit.payload))
        return block_id

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (finish, abort, preemption). Tail blocks are queued for
        eviction before the prefix blocks they extend, and unhashed blocks before any."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.hash == NO_HASH:
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def free_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past those that hold `num_tokens` tokens (rejected speculative
        proposals' slots). They are fresh, unhashed blocks: first in line to be reused."""
        keep = -(-num_tokens // BLOCK_SIZE)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None
                self.free_queue.move_to_end(block.block_id, last=False)

    # -- hashing computed blocks ------------------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Give every block whose tokens are all computed its chained hash, so later requests
        with the same prefix can share it."""
        if not self.is_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // BLOCK_SIZE, len(seq.block_table))
        # Blocks are hashed in order from the first, so a hashed last full block means there is
        # nothing new: the common decode step returns here instead of walking the whole table.
        if num_full == 0 or self.blocks[seq.block_table[num_full - 1]].hash != NO_HASH:
            return
        parent = root_hash(seq)
        for index in range(num_full):
            block = self.blocks[seq.block_table[index]]
            if block.hash != NO_HASH:
                parent = block.hash
                continue
            tokens = tuple(seq.token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
            parent = block_hash(parent, tokens)
            block.hash, block.token_ids = parent, tokens
            # Another sequence may have computed the same block meanwhile; keep the first.
            self.hash_to_block.setdefault(parent, block.block_id)
