"""Speculative decoding by prompt lookup (vLLM's `ngram` method), pure Python.

A decoding sequence whose last few tokens appeared earlier in its own text (a summary quoting its
source, a code edit repeating the file) proposes the tokens that followed them then. The step
runs the last known token and the k proposals through the model at once, like a short prefill
chunk over the cached context; the model's own choice at each position is kept, and the
proposals count only as far as they agree with it (see `num_accepted`). Greedy output is the
same token for token as without speculation, and a step yields 1 + accepted tokens instead of 1.

Sampled requests propose too, and the same rule is rejection sampling: each position's token is
drawn from the target distribution p (its own draw, with the proposals before it as context),
and a proposal d is kept when the draw equals it. A lookup proposes d with certainty (q = one-hot
on d), so speculative sampling's rule (keep d with probability min(1, p(d) / q(d)) = p(d); on a
rejection draw from the residual (p - q)+, which is p without d, renormalised) is exactly this:
the draw equals d with probability p(d), and a draw that differs is distributed as p given "not
d". Every emitted token keeps its distribution (tests/runtime/test_rt_spec_sampling.py).

Not proposing: requests with a grammar (the matcher would have to advance over the proposals)
and seeded requests, whose draws follow their own generator one token at a time so that a seed
gives the same text with and without speculation, whatever else the server runs. Configured as
vLLM does: `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4}'`.
"""

from __future__ import annotations

from typing import Protocol

from kvpilot.contract.speculative_config import SpeculativeConfig
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.scheduler import ScheduledSequence
from kvpilot.runtime.engine.sequence import DraftPace, Sequence

# A sequence whose proposals were all rejected waits 1, 3, 7, 15 steps (at most this many)
# before it proposes again: a proposal is a row in the step's matmuls whether accepted or not.
MAX_SKIP_STEPS = 15


class Proposer(Protocol):
    """Where a step's proposals come from. `reserve` runs before scheduling and gives each
    proposing sequence its proposals, or placeholders the scheduler reserves slots for; `fill`
    runs after it and replaces the placeholders of the scheduled ones."""

    def reserve(self, seq: Sequence, budget: int) -> list[int]: ...

    def fill(self, scheduled: list[ScheduledSequence]) -> None: ...

    def release(self, request_id: str) -> None:
        """The sequence finished, or was preempted (its blocks went back to the pool)."""


class NgramProposer:
    """Prompt lookup: the proposals are known before scheduling."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def reserve(self, seq: Sequence, budget: int) -> list[int]:
        return propose(seq.token_ids, self.config, budget)

    def fill(self, scheduled: list[ScheduledSequence]) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass


def propose(token_ids: list[int], config: SpeculativeConfig, limit: int) -> list[int]:
    """Up to min(k, limit) tokens that followed an earlier occurrence of the longest suffix of
    `token_ids` (at most prompt_lookup_max tokens, at least prompt_lookup_min); see `_match`."""
    count = min(config.num_speculative_tokens, limit)
    if count <= 0 or len(token_ids) < 2:
        return []
    start, size = _match(token_ids, config.prompt_lookup_max, count)
    if size < config.prompt_lookup_min:
        return []
    return token_ids[start + size : start + size + count]


def _match(token_ids: list[int], max_size: int, count: int) -> tuple[int, int]:
    """(start, size) of the earlier occurrence of a suffix of `token_ids` to propose from: the
    longest (up to max_size), then the one with the most tokens after it (up to `count`), then
    the most recent. The second rule matters in a loop: the latest occurrence of a repeating
    run's suffix is one period back, with only a period's worth of tokens after it. Size 0 when
    the last token never occurred before.

    One pass, backwards: `list.index` on the reversed copy finds each earlier occurrence of the
    last token at C speed, and only those are compared further. In the reversed copy the suffix
    starts at 0, and an occurrence at `position` has `position` tokens after it."""
    reverse = token_ids[::-1]
    best_start, best_key = 0, (0, 0)
    position = 1
    while best_key < (max_size, count):
        try:
            position = reverse.index(reverse[0], position)
        except ValueError:
            break
        size = 1
        while size < max_size and position + size < len(reverse):
            if reverse[position + size] != reverse[size]:
                break
            size += 1
        key = (size, min(position, count))
        if key > best_key:  # a tie further back is older: the first found stays
            best_start, best_key = len(token_ids) - position - size, key
        position += 1
    return best_start, best_key[0]


def pace(
    previous: DraftPace, num_speculative_tokens: int, num_proposed: int, num_accepted: int
) -> DraftPace:
    """The budget after a step that proposed `num_proposed` tokens, `num_accepted` of them
    kept: all kept, one more next time (up to k); some, one more than were kept; none, one
    token, after a wait that doubles with each miss in a row. A sequence whose text keeps
    repeating proposes k a step; one whose matches are chance spends few rows on them."""
    if num_accepted == num_proposed:
        budget = previous.budget if previous.budget is not None else num_speculative_tokens
        return DraftPace(budget=min(num_speculative_tokens, budget + 1))
    if num_accepted > 0:
        return DraftPace(budget=num_accepted + 1)
    misses = previous.misses + 1
    return DraftPace(budget=1, skip=min(2**misses - 1, MAX_SKIP_STEPS), misses=misses)


def draft_budget(seq: Sequence, config: SpeculativeConfig, max_model_len: int) -> int:
    """Proposals `seq` may make this step: what fits (`draft_limit`) within its pace; 0 while
    it waits out a miss (the step counts the wait down)."""
    current = seq.draft_pace
    if current.skip:
        seq.draft_pace = DraftPace(current.budget, current.skip - 1, current.misses)
        return 0
    budget = config.num_speculative_tokens if current.budget is None else current.budget
    return min(budget, draft_limit(seq, max_model_len))


def may_speculate(params: SamplingParams) -> bool:
    """Whether a request proposes at all: not with a grammar, not with a seed."""
    return params.grammar is None and params.seed is None


def can_speculate(seq: Sequence) -> bool:
    """Whether `seq` may propose this step: it may at all, and it is decoding (one behind)."""
    return may_speculate(seq.params) and seq.num_uncomputed_tokens == 1


def draft_limit(seq: Sequence, max_model_len: int) -> int:
    """Proposals that fit: the step yields up to limit + 1 tokens, within max_tokens and the
    model's context."""
    left_in_request = seq.params.max_tokens - seq.num_output_tokens - 1
    left_in_context = max_model_len - seq.num_tokens - 1
    return max(0, min(left_in_request, left_in_context))


def num_accepted(drafts: list[int], chosen: list[int]) -> int:
    """How many proposals the model agreed with, from the first: `chosen[i]` is the model's
    token after the context and drafts[:i]; the first disagreement ends the run."""
    count = 0
    for draft, token in zip(drafts, chosen, strict=False):
        if draft != token:
            break
        count += 1
    return count
