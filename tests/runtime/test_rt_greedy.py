"""Greedy outputs equal transformers' generate() token for token for 32 prompts run together:
plainly, with shared prefixes through the prefix cache, under forced preemption and with chunked
prefill. EOS handling is live on both sides, so early stops must agree too."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.reference.models import (
    GREEDY_NEW_TOKENS,
    TINY_LLAMA,
    make_prompts,
    quoting,
    qwen3_checkpoint,
    run_all,
    truncated_llama,
)
from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.draft_model import DraftModelProposer
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.spec_governor import Governor

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model


@pytest.fixture(scope="module")
def reference(hf_tiny_llama: Any) -> Callable[[list[int]], list[int]]:
    cache: dict[tuple[int, ...], list[int]] = {}

    def generate(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            with torch.no_grad():
                out = hf_tiny_llama.generate(
                    torch.tensor([prompt]), max_new_tokens=GREEDY_NEW_TOKENS, do_sample=False
                )
            cache[key] = out[0, len(prompt) :].tolist()
        return cache[key]

    return generate


def assert_matches(engine: Engine, prompts: list[list[int]], reference: Callable) -> None:
    got = run_all(engine, prompts)
    for index, prompt in enumerate(prompts):
        assert got[str(index)] == reference(prompt), f"prompt {index} ({len(prompt)} tokens)"
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # nothing leaked


def peak_blocks(prompts: list[list[int]]) -> int:
    return sum(-(-(len(p) + GREEDY_NEW_TOKENS) // BLOCK_SIZE) for p in prompts)


def block_bytes(engine: Engine) -> int:
    cfg = engine.model_config
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * BLOCK_SIZE  # fp32


@pytest.mark.parametrize("attention_backend", ["paged", "sdpa"])
def test_batched_greedy_matches_transformers(
    tiny_llama_dir: Path,
    make_engine: Callable[..., Engine],
    reference: Callable,
    attention_backend: str,
) -> None:
    """Both decode attention backends (the default on CPU is the paged kernel, which the other
    tests here run)."""
    prompts = make_prompts(tiny_llama_dir, shared_prefix=0)
    engine = make_engine(enable_prefix_caching=False, attention_backend=attention_backend)
    assert engine.attention_backend == attention_backend
    assert_matches(engine, prompts, reference)


def test_prefix_cached_greedy_matches_transformers(
    tiny_llama_dir: Path, make_engine: Callable[..., Engine], reference: Callable
) -> None:
    prompts = make_prompts(tiny_llama_dir, shared_prefix=100)
    engine = make_engine(enable_prefix_caching=True)
    assert_matches(engine, prompts, reference)
    first_hits = engine.stats().prefix_cache_hits
    assert first_hits > 0  # later prompts of a group reuse blocks of earlier ones
    assert_matches(engine, prompts, reference)  # warm: whole prompts' full blocks are cached
    assert engine.stats().prefix_cache_hits - first_hits >= sum(
        (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts
    )


def test_greedy_under_forced_preemption_matches_transformers(
    tiny_llama_dir: Path, make_engine: Callable[..., Engine], reference: Callable
) -> None:
    prompts = make_prompts(tiny_llama_dir, shared_prefix=0)
    probe = make_engine(max_model_len=256)
    pool_blocks = max(peak_blocks(prompts) // 4, 256 // BLOCK_SIZE)
    engine = make_engine(max_model_len=256, kv_cache_memory=pool_blocks * block_bytes(probe))
    assert engine.stats().num_total_blocks == pool_blocks
    assert_matches(engine, prompts, reference)
    assert engine.stats().num_preemptions > 0


def test_greedy_under_priority_preemption_matches_transformers(
    tiny_llama_dir: Path, make_engine: Callable[..., Engine], reference: Callable
) -> None:
    """Low-priority requests fill the batch; better ones arriving mid-decode preempt them. The
    victims resume (from the prefix cache) and every output is still transformers' own."""
    prompts = make_prompts(tiny_llama_dir, shared_prefix=0)[:12]
    engine = make_engine(scheduling_policy="priority", max_num_seqs=4)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}

    def add(indices: range, priority: int) -> None:
        params = SamplingParams(max_tokens=GREEDY_NEW_TOKENS, temperature=0, priority=priority)
        for index in indices:
            engine.add_request(prompts[index], params, str(index))

    add(range(8), priority=1)
    for step in range(1000):
        if step == 6:  # the first four are decoding, four more wait
            add(range(8, 12), priority=0)
        if step > 6 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    for index, prompt in enumerate(prompts):
        assert tokens[str(index)] == reference(prompt), f"prompt {index}"
    assert engine.scheduler.preemptions["priority"] >= 1  # a newcomer took a low one's seat
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_greedy_with_chunked_prefill_matches_transformers(
    tiny_llama_dir: Path, make_engine: Callable[..., Engine], reference: Callable
) -> None:
    prompts = make_prompts(tiny_llama_dir, shared_prefix=0)
    assert_matches(make_engine(max_num_batched_tokens=48, max_num_seqs=12), prompts, reference)


@pytest.mark.parametrize(
    ("num_speculative_tokens", "attention_backend"), [(1, "auto"), (4, "auto"), (4, "sdpa")]
)
def test_speculative_greedy_matches_transformers(
    tiny_llama_dir: Path,
    make_engine: Callable[..., Engine],
    reference: Callable,
    num_speculative_tokens: int,
    attention_backend: str,
) -> None:
    prompts = quoting(make_prompts(tiny_llama_dir, shared_prefix=0))
    config = f'{{"method": "ngram", "num_speculative_tokens": {num_speculative_tokens}}}'
    engine = make_engine(speculative_config=config, attention_backend=attention_backend)
    assert_matches(engine, prompts, reference)
    stats = engine.stats()
    assert stats.spec_decode_drafts > 0
    assert 0 < stats.spec_decode_accepted_tokens <= stats.spec_decode_draft_tokens
    assert stats.spec_decode_draft_tokens <= stats.spec_decode_drafts * num_speculative_tokens


class Alternating(Governor):
    """Proposals every other step, whatever they measure; remembers what it said last."""

    said: bool | None = None

    def pays(self, num_rows: int) -> bool:
        self.steps += 1
        self.proposing = self.said = self.steps % 2 == 1
        return self.proposing


def test_speculative_greedy_matches_transformers_as_proposals_start_and_stop(
    tiny_llama_dir: Path, make_engine: Callable[..., Engine], reference: Callable
) -> None:
    """A step the governor keeps from proposing runs no proposal, not even one left from the
    step before by a sequence the token budget left out. Stale proposals would not change
    greedy output (the model rejects them) but would cost rows and count the step as one with
    proposals. The second run finds every prompt cached, so all 32 sequences decode from its
    first steps, and 48 tokens hold the proposals of fewer than 10."""
    prompts = quoting(make_prompts(tiny_llama_dir, shared_prefix=0))
    engine = make_engine(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 4}',
        max_num_batched_tokens=48,
        enable_prefix_caching=True,
    )
    governor = engine.spec_step.governor = Alternating()
    execute = engine.runner.execute
    steps_without = []

    def checked(scheduled: list[Any]) -> Any:
        if governor.said is False:
            steps_without.append(sum(item.num_draft_tokens for item in scheduled))
        governor.said = None
        return execute(scheduled)

    engine.runner.execute = checked  # type: ignore[method-assign,assignment]
    assert_matches(engine, prompts, reference)
    assert_matches(engine, prompts, reference)
    assert engine.stats().spec_decode_accepted_tokens > 0
    assert len(steps_without) > 5 and not any(steps_without)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Draft models with tiny-llama's tokenizer: itself (agrees on every proposal), its first two
    of four layers (agrees often), a random Qwen3 (rarely)."""
    root = tmp_path_factory.mktemp("drafts")
    qwen3_checkpoint(root / "qwen3", tied=False)
    return {
        "itself": TINY_LLAMA,
        "two of its layers": truncated_llama(root / "two-layers", 2),
        "a random qwen3": root / "qwen3",
    }


def draft_config(draft: Path, num_speculative_tokens: int) -> str:
    return json.dumps(
        {
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": num_speculative_tokens,
        }
    )


@pytest.mark.parametrize(
    ("draft", "shared_prefix", "num_speculative_tokens"),
    [
        ("itself", 0, 4),
        ("two of its layers", 0, 3),
        ("two of its layers", 40, 4),  # through the prefix cache
        ("itself", 40, 4),  # the draft's KV too: hits start its runs after them
        ("a random qwen3", 0, 2),
    ],
)
def test_draft_model_greedy_matches_transformers(
    tiny_llama_dir: Path,
    make_engine: Callable[..., Engine],
    reference: Callable,
    drafts: dict[str, Path],
    draft: str,
    shared_prefix: int,
    num_speculative_tokens: int,
) -> None:
    prompts = quoting(make_prompts(tiny_llama_dir, shared_prefix=shared_prefix))
    engine = make_engine(speculative_config=draft_config(drafts[draft], num_speculative_tokens))
    assert_matches(engine, prompts, reference)
    stats = engine.stats()
    assert stats.spec_decode_drafts > 0
    assert stats.spec_decode_draft_tokens <= stats.spec_decode_drafts * num_speculative_tokens
    if draft == "itself":  # the same weights: only a near-tie in another batch can differ
        assert stats.spec_decode_accepted_tokens >= 0.99 * stats.spec_decode_draft_tokens, stats
    if shared_prefix:
        assert isinstance(engine.proposer, DraftModelProposer)
        assert engine.proposer.num_reused_tokens > 0
    if draft == "two of its layers":
        assert 0 < stats.spec_decode_accepted_tokens < stats.spec_decode_draft_tokens


@pytest.mark.parametrize(
    ("method", "kv_scale"),
    [("ngram", 1.0), ("draft_model", 2.0)],  # the draft (itself) doubles the KV per block
)
def test_speculative_greedy_under_forced_preemption_matches_transformers(
    tiny_llama_dir: Path,
    make_engine: Callable[..., Engine],
    reference: Callable,
    drafts: dict[str, Path],
    method: str,
    kv_scale: float,
) -> None:
    prompts = quoting(make_prompts(tiny_llama_dir, shared_prefix=0))
    probe = make_engine(max_model_len=256)
    pool_blocks = max(peak_blocks(prompts) // 4, 256 // BLOCK_SIZE)
    config = (
        '{"method": "ngram", "num_speculative_tokens": 3}'
        if method == "ngram"
        else draft_config(drafts["itself"], 3)
    )
    engine = make_engine(
        max_model_len=256,
        kv_cache_memory=int(pool_blocks * block_bytes(probe) * kv_scale),
        speculative_config=config,
    )
    assert engine.num_kv_blocks == pool_blocks
    assert_matches(engine, prompts, reference)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decode_accepted_tokens > 0
    if method == "draft_model":  # a preempted sequence's draft KV is recomputed, not stale
        assert stats.spec_decode_accepted_tokens >= 0.99 * stats.spec_decode_draft_tokens, stats
