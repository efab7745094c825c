"""Speculative decoding keeps a sampled request's distribution.

A step samples every position of a sequence that proposed (the next token, then the token after
each proposal as if the ones before it were kept), each draw on its own, and keeps the draws up
to and including the first that differs from its proposal (`speculative.num_accepted`). For a
proposal made with certainty (prompt lookup) that is speculative sampling's rejection rule, so
each emitted token must be distributed as the filtered target distribution at its position:
checked here over many trials of the sampler itself.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.runtime.engine import speculative
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.layers.sampler import SamplingRow, filter_logits, sample

TRIALS = 30_000
# Logits at three positions over a vocabulary of 5: the next token, then after proposal 2, then
# after proposals 2 and 0. Proposal 2 is the likeliest at position 0, proposal 0 not at position 1.
LOGITS = torch.tensor(
    [
        [0.1, 0.5, 1.6, -0.3, 0.2],
        [0.6, 0.9, 0.3, 1.2, -0.5],
        [0.4, -0.2, 0.7, 0.1, 1.0],
    ]
)
DRAFTS = [2, 0]


def emitted(tokens: list[int]) -> list[int]:
    """One trial's kept tokens, as the runner keeps them."""
    return tokens[: speculative.num_accepted(DRAFTS, tokens) + 1]


def frequency(outcomes: list[list[int]], position: int, vocab: int) -> tuple[torch.Tensor, int]:
    """Among trials that emitted a token at `position`, how often each token came there."""
    reached = [out[position] for out in outcomes if len(out) > position]
    counts = torch.bincount(torch.tensor(reached, dtype=torch.long), minlength=vocab)
    return counts.double() / max(len(reached), 1), len(reached)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
    ids=["plain", "top-k", "top-p"],
)
def test_each_emitted_token_keeps_the_target_distribution(params: SamplingParams) -> None:
    positions, vocab = LOGITS.shape
    # The context a row sees does not change these logits; the rows only carry the params.
    rows = [SamplingRow(params, [0] * (1 + i), 1) for _ in range(TRIALS) for i in range(positions)]
    logits = LOGITS.repeat(TRIALS, 1)
    tokens, _ = sample(logits, rows, torch.Generator().manual_seed(0))
    outcomes = [emitted(tokens[t * positions : (t + 1) * positions]) for t in range(TRIALS)]
    target = filter_logits(LOGITS, [params] * positions).softmax(-1).double()
    for position in range(positions):
        observed, reached = frequency(outcomes, position, vocab)
        assert reached > 1_000, f"too few trials reached position {position} to judge"
        # Five standard errors of a binomial proportion: a wrong rule is off by far more.
        margin = 5 * (target[position] * (1 - target[position]) / reached).sqrt() + 1e-3
        assert torch.all((observed - target[position]).abs() <= margin), (
            position,
            observed,
            target[position],
        )
    # Proposals did their job: most trials kept the likely first one.
    assert sum(len(out) > 1 for out in outcomes) > TRIALS * 0.4
