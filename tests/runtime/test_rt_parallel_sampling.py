"""n > 1 choices of one prompt (computed once, the others read it from the prefix cache), and
prompt logprobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine import model_runner
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

PROMPT = list(range(5, 105))  # 100 tokens: 6 full blocks before the last token's block


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams, str]]) -> dict:
    engine.add_requests(requests)
    tokens: dict[str, list[int]] = {request_id: [] for _, _, request_id in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)


@pytest.mark.parametrize("num_choices", [2, 4])
def test_choices_read_the_prompt_from_the_cache(
    make_engine: Callable[..., Engine], num_choices: int
) -> None:
    engine = make_engine()
    requests = [(PROMPT, sampled(seed), f"c{seed}") for seed in range(num_choices)]
    tokens = run(engine, requests)
    stats = engine.stats()
    cacheable = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert stats.prefix_cache_hits == (num_choices - 1) * cacheable
    assert stats.prefix_cache_queries == num_choices * len(PROMPT)
    assert len({tuple(ids) for ids in tokens.values()}) == num_choices  # seeds differ
    assert all(len(ids) == 12 for ids in tokens.values())


def test_a_choice_is_the_request_it_would_be_alone(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    together = run(engine, [(PROMPT, greedy, f"g{i}") for i in range(3)])
    alone = run(make_engine(), [(PROMPT, greedy, "alone")])["alone"]
    assert list(together.values()) == [alone] * 3


def test_without_prefix_caching_every_choice_computes_the_prompt(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(enable_prefix_caching=False)
    tokens = run(engine, [(PROMPT, sampled(seed), f"c{seed}") for seed in range(3)])
    assert engine.stats().prefix_cache_hits == 0
    assert all(len(ids) == 12 for ids in tokens.values())


def test_aborting_the_first_choice_leaves_the_others_running(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine()
    engine.add_requests([(PROMPT, sampled(seed), f"c{seed}") for seed in range(3)])
    engine.abort("c0")  # before the first step: the followers were waiting on it
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert reasons == {"c0": "abort", "c1": "length", "c2": "length"}


def test_request_ids_of_one_call_must_be_distinct(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="collide"):
        engine.add_requests([(PROMPT, sampled(0), "same"), (PROMPT, sampled(1), "same")])
    assert not engine.has_unfinished_requests()  # all or none


def prompt_logprobs_of(engine: Engine, prompt: list[int], params: SamplingParams) -> list:
    engine.add_request(prompt, params, "p")
    scored = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert scored is None, "prompt logprobs come once"
                scored = out.prompt_logprobs
    assert scored is not None
    return scored


@pytest.mark.parametrize(
    ("max_num_batched_tokens", "logits_rows"),
    [(512, 256), (16, 256), (512, 5)],
    ids=["whole prefill", "chunked prefill", "logits 5 rows at a time"],
)
def test_prompt_logprobs_are_transformers_log_softmax(
    make_engine: Callable[..., Engine],
    hf_tiny_llama: Any,
    monkeypatch: pytest.MonkeyPatch,
    max_num_batched_tokens: int,
    logits_rows: int,
) -> None:
    monkeypatch.setattr(model_runner, "PROMPT_LOGITS_ROWS", logits_rows)
    engine = make_engine(max_num_batched_tokens=max_num_batched_tokens)
    prompt = [1, *engine.tokenizer.encode("The sort method orders a list in place, and returns")]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    with torch.no_grad():
        reference = hf_tiny_llama(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for _ in range(2):  # the second time the prompt is cached, and must be scored all the same
        scored = prompt_logprobs_of(engine, prompt, params)
        assert [s.token_id for s in scored] == prompt[1:]
        for position, s in enumerate(scored):
            row = reference[position]
            assert s.logprob == pytest.approx(float(row[s.token_id]), abs=1e-3)
            assert s.rank == int((row > row[s.token_id]).sum()) + 1
            top = row.topk(3)
            assert list(s.top) == top.indices.tolist()
            assert list(s.top.values()) == pytest.approx(top.values.tolist(), abs=1e-3)
