"""Speculative decoding of sampled requests in the engine (the rule itself, that every emitted
token keeps its distribution, is tests/runtime/test_rt_spec_sampling.py): unseeded sampled
requests propose and have proposals accepted, from prompt lookup and from a draft model; a
seeded request does not propose, so its text is the same with and without speculation."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.reference.models import make_prompts, quoting, run_all
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'


def draft(model: Path) -> str:
    """tiny-llama as its own draft: its greedy proposals are often what a draw at 0.5 picks."""
    return json.dumps({"method": "draft_model", "model": str(model), "num_speculative_tokens": 4})


NEW_TOKENS = 24


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_requests_propose_and_keep_accepted_proposals(
    tiny_llama_dir: Path, make_engine: Callable[..., Engine], method: str
) -> None:
    prompts = quoting(make_prompts(tiny_llama_dir, shared_prefix=0))
    engine = make_engine(speculative_config=NGRAM if method == "ngram" else draft(tiny_llama_dir))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.5, top_p=0.95, ignore_eos=True)
    got = run_all(engine, prompts, params)
    assert all(len(tokens) == NEW_TOKENS for tokens in got.values())
    stats = engine.stats()
    assert 0 < stats.spec_decode_accepted_tokens <= stats.spec_decode_draft_tokens
    assert stats.num_free_blocks == stats.num_total_blocks  # rejected proposals' slots freed


def test_a_seeded_request_gives_the_same_text_with_and_without_speculation(
    tiny_llama_dir: Path, make_engine: Callable[..., Engine]
) -> None:
    prompts = quoting(make_prompts(tiny_llama_dir, shared_prefix=0))[:8]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=11, ignore_eos=True)
    plain = run_all(make_engine(), prompts, params)
    for config in (NGRAM, draft(tiny_llama_dir)):
        speculating = make_engine(speculative_config=config)
        assert run_all(speculating, prompts, params) == plain
        assert speculating.stats().spec_decode_drafts == 0
