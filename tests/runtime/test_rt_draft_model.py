"""What a draft model must share with the served model before it may propose for it, and which
of a sequence's blocks already hold the draft's KV (prefix-cache hits)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.reference.models import TINY_LLAMA
from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.block_manager import NO_HASH, BlockManager, block_hash
from kvpilot.runtime.engine.draft_model import (
    DraftModelProposer,
    check_draft,
    check_draft_positions,
)
from kvpilot.runtime.engine.scheduler import ScheduledSequence
from kvpilot.runtime.engine.sequence import Sequence
from kvpilot.runtime.models.loader import ModelConfig, load_model_config

SERVED = load_model_config(TINY_LLAMA)  # 4096 output rows, 2048 positions
VOCAB = {"<s>": 0, "the": 1, "and": 2}
DRAFT_DIR = Path("/models/draft")


@pytest.mark.parametrize(
    ("draft", "draft_vocab", "error"),
    [
        (replace(SERVED, num_layers=1, hidden_size=64), VOCAB, None),
        (replace(SERVED, vocab_size=4000), VOCAB, None),  # fewer output rows: ids it can make
        (SERVED, {**VOCAB, "the": 2, "and": 1}, "has another tokenizer than the served model"),
        (SERVED, {**VOCAB, "or": 3}, r"another tokenizer .*\(4 vs 3 tokens"),
        (replace(SERVED, vocab_size=5000), VOCAB, "5000 output rows, more than the served"),
    ],
)
def test_a_draft_shares_the_served_models_tokenizer(
    draft: ModelConfig, draft_vocab: dict[str, int], error: str | None
) -> None:
    if error is None:
        check_draft(DRAFT_DIR, draft, draft_vocab, SERVED, VOCAB)
        return
    with pytest.raises(ValueError, match=error):
        check_draft(DRAFT_DIR, draft, draft_vocab, SERVED, VOCAB)


@pytest.mark.parametrize(("max_model_len", "fits"), [(2048, True), (2049, False)])
def test_a_draft_must_reach_max_model_len(max_model_len: int, fits: bool) -> None:
    if fits:
        check_draft_positions(DRAFT_DIR, SERVED, max_model_len)
        return
    with pytest.raises(ValueError, match="handles 2048 positions, fewer than --max-model-len 2049"):
        check_draft_positions(DRAFT_DIR, SERVED, max_model_len)


# -- the draft's KV through prefix-cache hits ---------------------------------------------------

BS = BLOCK_SIZE


def computed(blocks: BlockManager, request_id: str, token_ids: list[int]) -> Sequence:
    """A sequence the served model has run up to its last token (a decode), its full blocks
    hashed, as after its prefill."""
    seq = Sequence(request_id, token_ids)
    cached = blocks.find_cached_blocks(seq)
    blocks.allocate_slots(seq, len(token_ids) - 1 - len(cached) * BS, cached)
    seq.num_computed_tokens = len(token_ids) - 1
    blocks.cache_full_blocks(seq)
    return seq


def draft_start(proposer: DraftModelProposer, seq: Sequence) -> int:
    """Where the draft's first run of `seq` this step begins (its proposals need a slot)."""
    return proposer._catch_up(ScheduledSequence(seq, 2, 1)).seq.num_computed_tokens


def draft_proposer(blocks: BlockManager) -> DraftModelProposer:
    runner = SimpleNamespace(model=SimpleNamespace(cfg=SERVED))  # no model: bookkeeping only
    proposer = DraftModelProposer(runner)  # type: ignore[arg-type]
    proposer.blocks = blocks
    return proposer


@pytest.fixture
def setup() -> tuple[BlockManager, DraftModelProposer]:
    blocks = BlockManager(num_blocks=8)
    return blocks, draft_proposer(blocks)


def test_a_prefix_hit_starts_the_draft_after_the_blocks_it_wrote(
    setup: tuple[BlockManager, DraftModelProposer],
) -> None:
    blocks, proposer = setup
    prompt = list(range(2 * BS + 5))
    first = computed(blocks, "a", prompt)
    assert draft_start(proposer, first) == 0  # nothing of it in the draft's pool yet
    second = computed(blocks, "b", prompt[: 2 * BS] + [99] * 5)
    assert second.block_table[:2] == first.block_table[:2]  # the served model's hit
    assert draft_start(proposer, second) == 2 * BS
    assert proposer.num_reused_tokens == 2 * BS


def test_a_block_hashed_before_the_draft_ran_there_is_not_reused(
    setup: tuple[BlockManager, DraftModelProposer],
) -> None:
    """Served-model hits the draft never wrote (the first sequence did not propose)."""
    blocks, proposer = setup
    prompt = list(range(2 * BS + 5))
    computed(blocks, "a", prompt)
    assert draft_start(proposer, computed(blocks, "b", prompt)) == 0


def test_a_block_evicted_and_refilled_is_not_taken_for_its_old_content() -> None:
    """Two blocks. A's first block (block 0, draft KV written) is evicted for X, whose draft
    writes X's tokens into block 0 while they are not hashed; then the served model alone fills
    block 0 with A's first block again: its hash is A's, its draft KV is X's."""
    blocks = BlockManager(num_blocks=2)
    proposer = draft_proposer(blocks)
    a_tokens = list(range(BS + 3))
    a = computed(blocks, "a", a_tokens)
    assert a.block_table == [0, 1]
    draft_start(proposer, a)
    blocks.free(a)
    proposer.release("a")
    x = computed(blocks, "x", [7] * (BS + 3))
    assert x.block_table == [1, 0]  # block 0 now holds X's last, unhashed tokens
    assert draft_start(proposer, x) == 0
    blocks.free(x)
    proposer.release("x")
    again = computed(blocks, "a-again", a_tokens)
    assert again.block_table[0] == 0
    assert blocks.blocks[0].hash == block_hash(NO_HASH, tuple(a_tokens[:BS]))
    assert draft_start(proposer, again) == 0
