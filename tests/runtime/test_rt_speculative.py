"""Prompt-lookup speculative decoding (engine/speculative.py) and what the scheduler does with the
proposals: scheduled after the last token within the budget, accepted ones computed, the rejected
ones' blocks given back."""

from __future__ import annotations

import pytest

from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.contract.speculative_config import SpeculativeConfig, parse_config
from kvpilot.runtime.engine.block_manager import BlockManager
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.scheduler import Scheduler
from kvpilot.runtime.engine.sequence import DraftPace, Sequence, SequenceStatus
from kvpilot.runtime.engine.speculative import (
    can_speculate,
    draft_budget,
    draft_limit,
    num_accepted,
    pace,
    propose,
)
from kvpilot.runtime.engine.structured import GrammarSpec

NGRAM4 = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.mark.parametrize(
    ("tokens", "config", "limit", "expected"),
    [
        # The suffix [1, 2, 3] occurred at the start: what followed it is proposed.
        ([1, 2, 3, 4, 5, 6, 1, 2, 3], NGRAM4, 10, [4, 5, 6, 1]),
        # An occurrence with k tokens after it beats a more recent one with fewer...
        ([7, 8, 1, 9, 7, 8, 2, 7, 8], NGRAM4, 10, [1, 9, 7, 8]),
        # ... but with a limit of 3 both have enough, and the most recent wins.
        ([7, 8, 1, 9, 7, 8, 2, 7, 8], NGRAM4, 3, [2, 7, 8]),
        # A longer match is preferred over a more recent shorter one.
        ([5, 6, 7, 1, 4, 7, 9, 5, 6, 7], NGRAM4, 10, [1, 4, 7, 9]),
        # Capped by the limit (max_tokens or the context left).
        ([1, 2, 3, 4, 5, 6, 1, 2, 3], NGRAM4, 2, [4, 5]),
        ([1, 2, 3, 4, 5, 6, 1, 2, 3], NGRAM4, 0, []),
        # No earlier occurrence of even the last token: nothing.
        ([1, 2, 3, 4], NGRAM4, 10, []),
        # prompt_lookup_min 2: a one-token match proposes nothing.
        ([4, 9, 1, 4], SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=3), 10, []),
        # In a loop, the occurrence with k tokens after it, not the latest (one period back).
        ([3, 3, 3, 3], NGRAM4, 10, [3]),
        ([3, 3, 3, 3, 3, 3, 3, 3], NGRAM4, 10, [3, 3, 3, 3]),
        ([9, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2], NGRAM4, 10, [1, 2, 1, 2]),
        # Among equally long matches with enough tokens after them, the latest.
        ([5, 6, 1, 1, 1, 1, 5, 6, 2, 2, 2, 2, 5, 6], NGRAM4, 10, [2, 2, 2, 2]),
        ([], NGRAM4, 10, []),
        ([5], NGRAM4, 10, []),
    ],
)
def test_propose_takes_what_followed_the_longest_earlier_match(
    tokens: list[int], config: SpeculativeConfig, limit: int, expected: list[int]
) -> None:
    assert propose(tokens, config, limit) == expected


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"method": "ngram"}', None),
        ('{"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_max": 2}', None),
        ("ngram", "--speculative-config is not JSON"),
        ('["ngram"]', "must be a JSON object"),
        ("{}", 'needs a "method"'),
        ('{"method": "eagle"}', "unknown speculative method 'eagle'; supported: ngram, draft_"),
        ('{"method": "draft_model", "model": "x"}', None),
        ('{"method": "draft_model"}', 'method "draft_model" needs "model"'),
        ('{"method": "ngram", "model": "x"}', "model does not apply to method 'ngram'"),
        ('{"method": "draft_model", "model": 3}', "model must be a path, got 3"),
        (
            '{"method": "draft_model", "model": "x", "prompt_lookup_max": 3}',
            "prompt_lookup_max does not apply to method 'draft_model'",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 0}', r"must be in \[1, 16\], got 0"),
        ('{"method": "ngram", "num_speculative_tokens": 17}', r"must be in \[1, 16\], got 17"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be an integer"),
        (
            '{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
            "<= prompt_lookup_max",
        ),
        ('{"method": "ngram", "n": 3}', r"unknown key\(s\) n; known: method"),
    ],
)
def test_parse_config_says_what_is_wrong(text: str, error: str | None) -> None:
    if error is None:
        assert parse_config(text).method in ("ngram", "draft_model")
        return
    with pytest.raises(
        ValueError, match=error if "\\" in error else error.replace("(", r"\(").replace(")", r"\)")
    ):
        parse_config(text)


@pytest.mark.parametrize(
    ("drafts", "chosen", "expected"),
    [([4, 5, 6], [4, 5, 6, 7], 3), ([4, 5, 6], [4, 9, 6, 7], 1), ([4], [8, 4], 0), ([], [3], 0)],
)
def test_num_accepted_counts_agreement_from_the_first(
    drafts: list[int], chosen: list[int], expected: int
) -> None:
    assert num_accepted(drafts, chosen) == expected


def start_running(scheduler: Scheduler, seq: Sequence) -> None:
    """`seq` running, its KV in the cache up to its last token (as after a decode step)."""
    computed, seq.num_computed_tokens = seq.num_computed_tokens, 0
    scheduler.block_manager.allocate_slots(seq, computed)
    seq.num_computed_tokens, seq.status = computed, SequenceStatus.RUNNING
    scheduler.running.append(seq)


def decoding(params: SamplingParams, prompt: int = 10, generated: int = 2) -> Sequence:
    seq = Sequence("r", list(range(prompt)), params)
    seq.token_ids += [1] * generated
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=0), True),
        (SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=0.5), True),
        (SamplingParams(temperature=0.7, seed=3), False),
        (SamplingParams(temperature=0, seed=3), False),
        (SamplingParams(temperature=0, grammar=GrammarSpec("regex", "a+")), False),
        (SamplingParams(temperature=0.7, grammar=GrammarSpec("regex", "a+")), False),
    ],
)
def test_requests_without_a_grammar_or_a_seed_propose(
    params: SamplingParams, expected: bool
) -> None:
    assert can_speculate(decoding(params)) is expected


@pytest.mark.parametrize(
    ("max_tokens", "max_model_len", "expected"),
    [(16, 1000, 13), (3, 1000, 0), (16, 14, 1), (16, 13, 0)],
)
def test_draft_limit_keeps_the_step_within_max_tokens_and_the_context(
    max_tokens: int, max_model_len: int, expected: int
) -> None:
    seq = decoding(SamplingParams(temperature=0, max_tokens=max_tokens))  # 12 tokens, 2 out
    assert draft_limit(seq, max_model_len) == expected


@pytest.mark.parametrize(
    ("previous", "proposed", "accepted", "expected"),
    [
        (DraftPace(), 4, 4, DraftPace(budget=4)),  # all kept: stays at k
        (DraftPace(budget=2), 2, 2, DraftPace(budget=3)),  # all kept: one more
        (DraftPace(budget=4), 4, 1, DraftPace(budget=2)),  # some: one more than were kept
        (DraftPace(budget=4), 4, 3, DraftPace(budget=4)),
        (DraftPace(budget=4), 4, 0, DraftPace(budget=1, skip=1, misses=1)),  # none: wait
        (DraftPace(budget=1, misses=1), 1, 0, DraftPace(budget=1, skip=3, misses=2)),
        (DraftPace(budget=1, misses=4), 1, 0, DraftPace(budget=1, skip=15, misses=5)),
        (DraftPace(budget=1, misses=9), 1, 0, DraftPace(budget=1, skip=15, misses=10)),  # cap
        (DraftPace(budget=1, misses=3), 1, 1, DraftPace(budget=2)),  # a hit forgives
    ],
)
def test_pace_follows_what_the_model_kept(
    previous: DraftPace, proposed: int, accepted: int, expected: DraftPace
) -> None:
    assert pace(previous, 4, proposed, accepted) == expected


def test_draft_budget_waits_out_a_miss_then_proposes_within_the_limit() -> None:
    config = SpeculativeConfig(num_speculative_tokens=4)
    seq = decoding(SamplingParams(temperature=0, max_tokens=16))  # room for 13
    seq.draft_pace = DraftPace(budget=1, skip=2, misses=2)
    assert [draft_budget(seq, config, 1000) for _ in range(3)] == [0, 0, 1]
    seq.draft_pace = DraftPace()
    assert draft_budget(seq, config, 1000) == 4
    assert draft_budget(seq, config, 14) == 1  # the context has room for one more


@pytest.mark.parametrize(("budget", "expected_drafts"), [(64, 4), (3, 2), (1, 0)])
def test_proposals_are_scheduled_after_the_last_token_within_the_budget(
    budget: int, expected_drafts: int
) -> None:
    scheduler = Scheduler(BlockManager(8), max_num_seqs=4, max_num_batched_tokens=budget)
    seq = decoding(SamplingParams(temperature=0), prompt=BLOCK_SIZE - 2)
    start_running(scheduler, seq)
    seq.draft_token_ids = [7, 8, 9, 10]
    (item,) = scheduler.schedule().scheduled
    assert (item.num_new_tokens, item.num_draft_tokens) == (1 + expected_drafts, expected_drafts)
    assert item.is_sampling and item.draft_token_ids == [7, 8, 9, 10][:expected_drafts]


@pytest.mark.parametrize(("accepted", "blocks_after"), [(0, 1), (1, 1), (2, 2), (4, 2)])
def test_accepted_proposals_are_computed_and_rejected_ones_leave_no_blocks(
    accepted: int, blocks_after: int
) -> None:
    manager = BlockManager(8)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    seq = decoding(SamplingParams(temperature=0), prompt=BLOCK_SIZE - 2, generated=1)
    start_running(scheduler, seq)  # BLOCK_SIZE - 1 tokens, all but the last computed
    seq.draft_token_ids = [7, 8, 9, 10]
    out = scheduler.schedule()
    (item,) = out.scheduled
    assert len(seq.block_table) == 2  # room for the last token and four proposals
    computed_before = seq.num_computed_tokens
    scheduler.update_after_step(out)
    seq.token_ids += [*[7, 8, 9, 10][:accepted], 42]  # the accepted ones, then the model's own
    scheduler.accept_drafts(item, accepted)
    assert seq.num_computed_tokens == computed_before + 1 + accepted == seq.num_tokens - 1
    assert seq.draft_token_ids == []
    assert len(seq.block_table) == blocks_after
    assert manager.num_free_blocks == 8 - blocks_after
