"""`kv_cache_dtype` through the engine and the eval tool on tiny-llama: the pool sized by the KV
bytes, greedy agreement and perplexity of fp8 KV against the model-dtype cache, clear errors.

Thresholds come from measurement on tiny-llama (CPU, float32 compute, KV scale 1.0):
- greedy, 32 prompts x 24 tokens: fp8 matched auto at 86% of positions, 23/32 prompts whole
  (a too-small scale of 0.01 that clips K/V: 51%, 5/32); bf16 and fp16 KV: 100%, 32/32.
- perplexity on the first 4 eval windows: fp8 +0.020%, bf16 -0.006%, fp16 +0.0003%.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import zip_longest
from pathlib import Path

import pytest
import torch

from bench.reference.models import make_prompts, run_all
from kvpilot.runtime.cli import main as cli_main
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.evaluate import (
    Sample,
    evaluate_level,
    perplexity,
    read_dataset,
    relative_loss,
    windows,
)
from kvpilot.runtime.models.tokenizer_files import Tokenizer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

BUDGET = 16 * 2**20  # KV bytes per token: 2 x 4 layers x 2 KV heads x 32 dims x dtype bytes


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "stored", "num_blocks"),
    [
        ("float32", "auto", torch.float32, 512),  # 16 MiB / (1024 values x 4 B x 16 per block)
        ("float32", "bf16", torch.bfloat16, 1024),
        ("float32", "fp16", torch.float16, 1024),
        ("float32", "fp8", torch.float8_e4m3fn, 2048),
        ("bfloat16", "auto", torch.bfloat16, 1024),  # a bf16 model: fp8 doubles its blocks
        ("bfloat16", "fp8", torch.float8_e4m3fn, 2048),
    ],
)
def test_pool_sizes_by_the_kv_dtype(
    make_engine: Callable[..., Engine],
    dtype: str,
    kv_cache_dtype: str,
    stored: torch.dtype,
    num_blocks: int,
) -> None:
    engine = make_engine(dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=BUDGET)
    assert engine.stats().num_total_blocks == num_blocks
    k_cache, v_cache = engine.runner.kv_caches[0]
    assert k_cache.data.dtype == v_cache.data.dtype == engine.kv_dtype == stored
    assert k_cache.data.shape[0] == num_blocks


@pytest.fixture(scope="module")
def auto_tokens(make_engine: Callable[..., Engine], tiny_llama_dir: Path) -> dict[str, list[int]]:
    return run_all(make_engine(), make_prompts(tiny_llama_dir, 0))


@pytest.mark.parametrize(
    ("kv_cache_dtype", "min_same_positions", "min_same_prompts"),
    [("fp8", 0.75, 18), ("bf16", 0.95, 30), ("fp16", 0.95, 30)],
)
def test_greedy_agrees_with_the_model_dtype_cache(
    make_engine: Callable[..., Engine],
    tiny_llama_dir: Path,
    auto_tokens: dict[str, list[int]],
    kv_cache_dtype: str,
    min_same_positions: float,
    min_same_prompts: int,
) -> None:
    """bf16 and fp16 KV on the float32 model (fp16 on CPU included) and fp8 KV, all 32 prompts
    together through decodes, batched in groups."""
    engine = make_engine(kv_cache_dtype=kv_cache_dtype)
    got = run_all(engine, make_prompts(tiny_llama_dir, 0))
    pairs = [  # an output that stops early (EOS) counts its missing tokens as different
        (a, b) for key in auto_tokens for a, b in zip_longest(auto_tokens[key], got[key])
    ]
    same_positions = sum(a == b for a, b in pairs) / len(pairs)
    same_prompts = sum(got[key] == auto_tokens[key] for key in auto_tokens)
    assert same_positions >= min_same_positions, f"{same_positions:.3f}"
    assert same_prompts >= min_same_prompts
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # nothing leaked


def test_fp8_perplexity_costs_under_a_tenth_of_a_percent(tiny_llama_dir: Path) -> None:
    """Measured +0.020% on these 2044 tokens; a scale of 0.01 (clipping K/V) costs +0.16%. The
    change must not be zero either: every token after a window's first reads the fp8 cache."""
    ids = Tokenizer(tiny_llama_dir).encode(read_dataset(tiny_llama_dir / "eval.txt"))
    chunks = [Sample(chunk) for chunk in windows(ids, 512)[:4]]
    base = perplexity(evaluate_level(tiny_llama_dir, "none", chunks, "float32", "cpu"))
    fp8 = perplexity(evaluate_level(tiny_llama_dir, "none", chunks, "float32", "cpu", "fp8"))
    assert 0 < abs(relative_loss(fp8, base)) < 1e-3, f"{relative_loss(fp8, base):+.5%}"


def test_eval_cli_takes_a_kv_cache_dtype(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = tmp_path / "short.txt"
    dataset.write_text((tiny_llama_dir / "eval.txt").read_text()[:3000])
    argv = ["eval", "--model", str(tiny_llama_dir), "--dataset", str(dataset), "--json"]
    assert cli_main([*argv, "--quantization", "none", "--kv-cache-dtype", "fp8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kv_cache_dtype"] == "fp8"
    assert result["baseline"]["kv_cache_dtype"] == "auto"
    assert 0 < abs(result["levels"]["none"]["relative_loss"]) < 1e-2
    assert cli_main([*argv[:-1], "--quantization", "int8", "--kv-cache-dtype", "fp8"]) == 0
    assert "int8+fp8" in capsys.readouterr().out


def test_fp8_without_torch_support_fails_before_loading(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_load(*args: object) -> None:
        raise AssertionError("the weights loaded before the KV dtype was checked")

    monkeypatch.delattr(torch, "float8_e4m3fn")
    monkeypatch.setattr("kvpilot.runtime.engine.loading.load_model", must_not_load)
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8 needs torch\.float8_e4m3fn"):
        make_engine(kv_cache_dtype="fp8")
