"""The batched sampler against the row-at-a-time reference (bench/reference/sampler.py).

Every case below sits in one mixed batch, as sequences do in a step; each drawn row has its own
seeded generator, so the reference can replay the same noise row by row.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from bench.reference import sampler as reference
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.layers import sampler
from kvpilot.runtime.layers.sampler import (
    SamplingRow,
    apply_logit_bias_,
    apply_min_tokens_,
    apply_penalties_,
    filter_logits,
    sample,
)

VOCAB = 64
EOS = (2,)
NUM_PROMPT = 12

# (name, SamplingParams fields, output tokens so far)
CASES: list[tuple[str, dict[str, Any], int]] = [
    ("greedy", {"temperature": 0}, 3),
    ("greedy + bias", {"temperature": 0, "logit_bias": ((5, 3.0), (7, -100.0))}, 2),
    ("greedy + repetition", {"temperature": 0, "repetition_penalty": 1.3}, 6),
    (
        "greedy + presence, frequency",
        {"temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 0.7},
        8,
    ),
    ("greedy + min_tokens", {"temperature": 0, "min_tokens": 5, "stop_token_ids": (9, 11)}, 2),
    ("min_tokens reached", {"temperature": 0, "min_tokens": 2, "stop_token_ids": (9,)}, 2),
    ("min_tokens, ignore_eos", {"temperature": 0, "min_tokens": 4, "ignore_eos": True}, 0),
    ("temperature", {"temperature": 0.7}, 1),
    ("hot top-k", {"temperature": 1.3, "top_k": 5}, 0),
    ("top-k 1", {"temperature": 2.0, "top_k": 1}, 0),
    ("top-k over vocab", {"temperature": 1.0, "top_k": 1000}, 0),
    ("top-p", {"temperature": 1.0, "top_p": 0.8}, 4),
    ("top-k + top-p + min-p", {"temperature": 0.9, "top_k": 10, "top_p": 0.9, "min_p": 0.05}, 3),
    ("min-p", {"temperature": 1.0, "min_p": 0.2}, 5),
    ("encouraging repetition", {"temperature": 1.0, "repetition_penalty": 0.8}, 7),
    ("negative frequency + top-k", {"temperature": 1.0, "frequency_penalty": -0.5, "top_k": 3}, 9),
    (
        "everything",
        {
            "temperature": 0.8,
            "top_k": 20,
            "top_p": 0.95,
            "min_p": 0.02,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.3,
            "repetition_penalty": 1.2,
            "logit_bias": ((3, 2.0),),
            "min_tokens": 8,
            "stop_token_ids": (4,),
        },
        5,
    ),
]


def make_rows(seed: int) -> list[SamplingRow]:
    """The cases with random contexts; small ids repeat, so penalties have something to do."""
    rng = torch.Generator().manual_seed(seed)
    rows = []
    for index, (_, fields, num_output) in enumerate(CASES):
        ids = torch.randint(0, 16, (NUM_PROMPT + num_output,), generator=rng).tolist()
        params = SamplingParams(max_tokens=16, **fields)
        generator = torch.Generator().manual_seed(1000 * seed + index)
        rows.append(SamplingRow(params, ids, NUM_PROMPT, generator))
    return rows


def make_logits(seed: int, num_rows: int = len(CASES)) -> torch.Tensor:
    rng = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=rng) * 3


def same_logits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to float rounding, -inf in the same places."""
    is_inf = expected == float("-inf")
    return bool(torch.equal(got == float("-inf"), is_inf)) and torch.allclose(
        got[~is_inf], expected[~is_inf], atol=1e-5
    )


@pytest.mark.parametrize("seed", range(8))
def test_batch_draws_the_reference_tokens(seed: int) -> None:
    logits = make_logits(seed)
    tokens, _ = sample(logits, make_rows(seed), torch.Generator().manual_seed(0), EOS)
    assert tokens == reference.sample_rows(logits, make_rows(seed), EOS)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[name for name, _, _ in CASES])
def test_processors_match_the_reference(case: int) -> None:
    logits, rows = make_logits(case), make_rows(case)
    got = logits.clone()
    apply_logit_bias_(got, rows)
    apply_min_tokens_(got, rows, EOS)
    apply_penalties_(got, rows)
    assert same_logits(got[case], reference.processed_logits(logits[case], rows[case], EOS))


@pytest.mark.parametrize("seed", range(6))
def test_filters_match_the_reference(seed: int) -> None:
    rows = [row for row in make_rows(seed) if not row.params.is_greedy]
    logits = make_logits(seed, len(rows))
    got = filter_logits(logits, [row.params for row in rows])
    for index, row in enumerate(rows):
        assert same_logits(got[index], reference.filtered_logits(logits[index], row))


@pytest.mark.parametrize("num_candidates", [4, 16, 1024])
def test_top_p_sorts_only_rows_its_candidates_do_not_cover(
    num_candidates: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flat rows (the candidates hold little mass) take the full sort, peaked rows do not; both
    must filter as the reference does."""
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", num_candidates)
    rng = torch.Generator().manual_seed(5)
    scales = [0.1, 8.0, 0.3, 5.0, 1.0, 0.05]
    logits = torch.cat([torch.randn(1, VOCAB, generator=rng) * scale for scale in scales])
    top_ps = [0.9, 0.9, 0.5, 0.99, 0.7, 0.3]
    rows = [SamplingRow(SamplingParams(top_p=p), [1], 1) for p in top_ps]
    got = filter_logits(logits, [row.params for row in rows])
    for index, row in enumerate(rows):
        assert same_logits(got[index], reference.filtered_logits(logits[index], row))


@pytest.mark.parametrize("num_candidates", [4, 1024])  # the full sort, and the candidates
def test_a_near_zero_top_p_keeps_greedys_token_among_tied_logits(
    num_candidates: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 logits tie often; top_p -> 0 keeps exactly the token argmax (greedy) picks, the first
    of the tied largest, whatever order topk or sort leave ties in."""
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", num_candidates)
    logits = torch.full((3, VOCAB), -4.0)
    for row, tied in enumerate([(3, 7), (9, 2, 5), (0, VOCAB - 1)]):
        logits[row, list(tied)] = 2.5
    got = filter_logits(logits, [SamplingParams(top_p=1e-9)] * 3)
    for row in range(3):
        kept = got[row].isfinite().nonzero().flatten().tolist()
        assert kept == [int(logits[row].argmax())]


def test_draws_follow_the_distribution() -> None:
    """20,000 rows of the same logits: each token's share is its probability (within 4 sigma)."""
    num_rows = 20_000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(num_rows, 1)
    rows = [SamplingRow(SamplingParams(temperature=0.8), [1], 1)] * num_rows
    tokens, _ = sample(logits, rows, torch.Generator().manual_seed(3))
    probs = (logits[0] / 0.8).softmax(-1).tolist()
    for token, p in enumerate(probs):
        share = tokens.count(token) / num_rows
        assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / num_rows), (token, share, p)


def test_a_seeded_row_draws_the_same_tokens_whatever_its_neighbours() -> None:
    def run(num_neighbours: int) -> list[int]:
        generator = torch.Generator().manual_seed(42)
        seeded = SamplingRow(SamplingParams(temperature=1.0, seed=42), [1], 1, generator)
        neighbour = SamplingRow(SamplingParams(temperature=1.5, top_p=0.9), [1], 1)
        shared = torch.Generator().manual_seed(num_neighbours)
        drawn = []
        for step in range(20):
            others = make_logits(100 + step, num_neighbours)
            logits = torch.cat([others, make_logits(step, 1)])  # its own row: the same
            rows = [neighbour] * num_neighbours + [seeded]
            drawn.append(sample(logits, rows, shared)[0][-1])
        return drawn

    assert run(0) == run(5) == run(17)
    assert len(set(run(3))) > 1  # it is drawing, not taking the argmax


def test_a_plain_greedy_batch_takes_the_argmax_with_raw_logprobs() -> None:
    logits = make_logits(1, 4)
    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=n), [1], 1) for n in (None, 0, 3, 5)]
    tokens, logprobs = sample(logits, rows)
    assert tokens == logits.argmax(-1).tolist()
    raw = logits.log_softmax(-1)
    assert logprobs[0] is None
    for row, num_top in ((1, 0), (2, 3), (3, 5)):
        entry = logprobs[row]
        assert entry is not None and len(entry) == max(num_top, 1)
        top = raw[row].topk(max(num_top, 1))
        assert entry == pytest.approx(
            dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        )


def test_logprobs_are_of_the_raw_distribution_even_when_bias_picks_the_token() -> None:
    logits = make_logits(2, 1)
    worst = int(logits[0].argmin())
    params = SamplingParams(temperature=0, logprobs=1, logit_bias=((worst, 100.0),))
    tokens, logprobs = sample(logits, [SamplingRow(params, [1], 1)])
    raw = logits[0].log_softmax(-1)
    assert tokens == [worst]
    assert logprobs[0] == pytest.approx(
        {worst: float(raw[worst]), int(raw.argmax()): float(raw.max())}
    )


def test_min_tokens_masks_eos_and_stop_ids_only_until_reached() -> None:
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, EOS[0]], logits[0, 9], logits[0, 30] = 10.0, 9.0, 1.0
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(9,))
    early = SamplingRow(params, [1, 5, 6], 1)  # 2 tokens out: EOS and 9 still masked
    done = SamplingRow(params, [1, 5, 6, 7], 1)  # 3 out: free to stop
    assert sample(logits, [early], None, EOS)[0] == [30]
    assert sample(logits, [done], None, EOS)[0] == [EOS[0]]


def test_min_tokens_yields_to_a_grammar_that_can_only_end() -> None:
    """A grammar mask that leaves only EOS (the grammar is complete) beats min_tokens: the row
    ends instead of drawing from an all -inf row; the rows beside it are masked as usual."""
    logits = torch.full((3, VOCAB), -5.0)
    logits[:, EOS[0]], logits[:, 30] = 10.0, 1.0
    logits[0, :] = float("-inf")  # row 0's grammar allows EOS alone
    logits[0, EOS[0]] = 0.0
    params = SamplingParams(temperature=0, min_tokens=3)
    rows = [SamplingRow(params, [1, 5], 1), SamplingRow(params, [1, 5], 1)]
    drawn = SamplingRow(SamplingParams(temperature=1.0, min_tokens=3, seed=0), [1, 5], 1)
    generators = torch.Generator().manual_seed(0)
    rows.append(SamplingRow(drawn.params, drawn.token_ids, 1, generators))
    tokens, _ = sample(logits, rows, None, EOS)
    assert tokens[0] == EOS[0]
    assert tokens[1] == 30 and tokens[2] != EOS[0]
