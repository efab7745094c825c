"""The FlashInfer backend's side of the contract, on a machine without a GPU: the pages, lengths
and query pointers `FlashInferAttention.plan` hands FlashInfer, read as FlashInfer documents
them, give the attention the SDPA path computes (decode rows with proposals, fresh chunks, chunks
over cached KV), and greedy decoding through them equals transformers'. FlashInfer's own kernels
need CUDA: bench/gpu/check.py runs the engine on them against transformers on a lent GPU.

`ReferenceFlashInfer` reads the arguments as FlashInfer's API documents them (CSR page lists,
`last_page_len`, a causal mask aligned to the end of the context) in plain torch, so these tests
check what kvpilot sends, not FlashInfer.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.reference.attention_batches import MIXED_STEP, fp8_exact, mixed_batch
from bench.reference.models import GREEDY_NEW_TOKENS, make_prompts, quoting, run_all
from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.model_runner import ModelRunner, load_model
from kvpilot.runtime.layers import flashinfer_attention
from kvpilot.runtime.layers.attention import paged_attention
from kvpilot.runtime.layers.flashinfer_attention import (
    FlashInferAttention,
    PagedLayout,
    paged_layout,
    query_indptr,
)
from kvpilot.runtime.models.loader import load_model_config

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model


@pytest.mark.parametrize(
    ("tables", "kv_lens", "expected"),
    [
        ([], [], PagedLayout([0], [], [])),
        ([[7]], [1], PagedLayout([0, 1], [7], [1])),
        ([[7]], [BLOCK_SIZE], PagedLayout([0, 1], [7], [BLOCK_SIZE])),  # a full last page
        ([[7, 3]], [BLOCK_SIZE + 1], PagedLayout([0, 2], [7, 3], [1])),
        ([[7, 3, 9]], [5], PagedLayout([0, 1], [7], [5])),  # blocks past the context: not read
        ([[4, 5], [6]], [20, 3], PagedLayout([0, 2, 3], [4, 5, 6], [4, 3])),
    ],
)
def test_paged_layout(tables: list[list[int]], kv_lens: list[int], expected: PagedLayout) -> None:
    assert paged_layout(tables, kv_lens, BLOCK_SIZE) == expected


@pytest.mark.parametrize(
    ("tables", "kv_lens", "message"),
    [([[1]], [0], "at least its own token"), ([[1]], [BLOCK_SIZE + 1], "need 2 blocks")],
)
def test_paged_layout_refuses_what_a_kernel_would_read_wrongly(
    tables: list[list[int]], kv_lens: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        paged_layout(tables, kv_lens, BLOCK_SIZE)


def test_query_indptr() -> None:
    assert query_indptr([]) == [0]
    assert query_indptr([12, 1, 7]) == [0, 12, 13, 20]


BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


@pytest.mark.parametrize(
    ("device", "dtype", "head_dim", "kv_dtype", "message"),
    [
        ("cpu", BF16, 128, BF16, "run on CUDA, not cpu"),
        ("cuda", torch.float32, 128, torch.float32, "float16 or bfloat16"),
        ("cuda", BF16, 96, BF16, "head sizes"),
        ("cuda", BF16, 128, torch.float16, "in the model dtype or fp8"),
    ],
)
def test_unavailable_reason(
    device: str, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype, message: str
) -> None:
    reason = flashinfer_attention.unavailable_reason(
        torch.device(device), dtype, head_dim, kv_dtype
    )
    assert reason is not None and message in reason


@pytest.mark.parametrize("kv_dtype", [BF16, FP8])
def test_fp8_kv_is_no_reason_and_a_missing_flashinfer_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, kv_dtype: torch.dtype
) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    reason = flashinfer_attention.unavailable_reason(torch.device("cuda"), BF16, 128, kv_dtype)
    assert reason is not None and "pip install flashinfer-python" in reason


def test_a_broken_flashinfer_install_is_a_reason_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An install built for another CUDA or torch raises more than ImportError as it imports;
    `auto` must still start, on SDPA, with the reason."""
    package = tmp_path / "flashinfer"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('CUDA 12.8 build, found CUDA 13.0')\n")
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    reason = flashinfer_attention.unavailable_reason(torch.device("cuda"), BF16, 128, BF16)
    assert reason is not None
    assert "RuntimeError: CUDA 12.8 build, found CUDA 13.0" in reason
    assert "--attention-backend sdpa" in reason


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [n, H, D], keys/values: [L, H_kv, D], visible: [n, L] -> [n, H, D]."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, keys) * scale
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", weights, values)


class ReferenceWrapper:
    """A FlashInfer paged wrapper's documented semantics in plain torch (NHD layout)."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", **_: Any) -> None:
        assert kv_layout == "NHD"
        self.rows: list[tuple[int, int, torch.Tensor, int]] = []  # (first q, num q, pages, kv)

    def _plan(
        self,
        qo_indptr: list[int],
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        page_size: int,
        scale: float | None,
    ) -> None:
        self.scale = scale
        self.rows = []
        for r in range(len(last_page_len)):
            pages = indices[int(indptr[r]) : int(indptr[r + 1])].long()
            kv_len = (len(pages) - 1) * page_size + int(last_page_len[r])
            first, end = qo_indptr[r], qo_indptr[r + 1]
            self.rows.append((first, end - first, pages, kv_len))

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
        out: torch.Tensor,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = paged_kv_cache
        assert (k_scale is not None) == (k_cache.dtype == FP8), "fp8 KV comes with its scales"
        scale = self.scale or q.shape[-1] ** -0.5
        for first, count, pages, kv_len in self.rows:
            keys = k_cache[pages].flatten(0, 1)[:kv_len].to(q.dtype) * (k_scale or 1.0)
            values = v_cache[pages].flatten(0, 1)[:kv_len].to(q.dtype) * (v_scale or 1.0)
            # causal, aligned to the context's end: query i sees keys <= kv_len - count + i
            visible = torch.ones(count, kv_len, dtype=torch.bool).tril(kv_len - count)
            out[first : first + count] = attend(
                q[first : first + count], keys, values, visible, scale
            )
        return out


class ReferenceDecode(ReferenceWrapper):
    def plan(
        self, indptr: Any, indices: Any, last_page_len: Any, num_qo_heads: int,
        num_kv_heads: int, head_dim: int, page_size: int, *, sm_scale: float | None = None,
        **_: Any,
    ) -> None:  # fmt: skip
        rows = list(range(len(last_page_len) + 1))  # one query per row
        self._plan(rows, indptr, indices, last_page_len, page_size, sm_scale)


class ReferencePrefill(ReferenceWrapper):
    def plan(
        self, qo_indptr: Any, indptr: Any, indices: Any, last_page_len: Any, num_qo_heads: int,
        num_kv_heads: int, head_dim: int, page_size: int, *, causal: bool = False,
        sm_scale: float | None = None, **_: Any,
    ) -> None:  # fmt: skip
        assert causal, "a prefill chunk must not see the tokens after its own"
        self._plan(qo_indptr.tolist(), indptr, indices, last_page_len, page_size, sm_scale)


@pytest.fixture
def reference_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = ReferenceDecode  # type: ignore[attr-defined]
    module.BatchPrefillWithPagedKVCacheWrapper = ReferencePrefill  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(flashinfer_attention, "WORKSPACE_BYTES", 1024)
    yield


def flashinfer_for(runner: ModelRunner) -> FlashInferAttention:
    cfg, kv_dtype = runner.model.cfg, runner.kv_caches[0][0].data.dtype
    return FlashInferAttention(
        runner.device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, runner.model.dtype,
        kv_dtype, BLOCK_SIZE,
    )  # fmt: skip


@pytest.mark.parametrize("kv_dtype", [None, FP8], ids=["model-dtype", "fp8"])
def test_a_planned_step_attends_as_sdpa_does(
    tiny_llama_dir: Path, reference_flashinfer: None, kv_dtype: torch.dtype | None
) -> None:
    """One step with plain decodes, a decode with three proposals (rows of their own lengths),
    a fresh prompt and two chunks over cached KV, all on shuffled blocks. fp8 at scales other
    than 1, which FlashInfer must be given; keys and values are multiples of 1/4 within +-4,
    exact in e4m3 at those scales, so reading a fresh chunk back from the cache (FlashInfer) or
    not (SDPA) gives the same numbers."""
    cfg = load_model_config(tiny_llama_dir)
    model = load_model(tiny_llama_dir, cfg, "none", torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, torch.device("cpu"), seed=0, attention_backend="sdpa")
    runner.allocate_kv_cache(64, kv_dtype, [(0.5, 0.25)] * cfg.num_layers)
    torch.manual_seed(0)
    for k_cache, v_cache in runner.kv_caches:
        for cache in (k_cache, v_cache):
            cache.write(fp8_exact(64 * BLOCK_SIZE, *cache.data.shape[2:]), torch.arange(64 * 16))
    batch = mixed_batch(64, MIXED_STEP)
    q_rows = sum(item.num_new_tokens for item in batch)
    q = torch.randn(q_rows, cfg.num_heads, cfg.head_dim)
    k, v = fp8_exact(2, q_rows, cfg.num_kv_heads, cfg.head_dim).unbind(0)
    k_cache, v_cache = runner.kv_caches[0]

    _, _, sdpa_meta, _ = runner.prepare(batch)
    expected = paged_attention(q, k, v, k_cache, v_cache, sdpa_meta, cfg.head_dim**-0.5)
    runner.flashinfer = flashinfer_for(runner)
    _, _, meta, _ = runner.prepare(batch)
    assert meta.flashinfer is not None and not meta.prefills and not meta.decodes
    assert meta.flashinfer.num_decode_rows == 1 + 1 + 4 + 1  # a proposal is a row of its own
    got = paged_attention(q, k, v, k_cache, v_cache, meta, cfg.head_dim**-0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_greedy_through_the_flashinfer_plans_matches_transformers(
    tiny_llama_dir: Path,
    make_engine: Callable[..., Engine],
    hf_tiny_llama: Any,
    reference_flashinfer: None,
) -> None:
    """Step after step: chunked prefill, prefix-cache hits and prompt-lookup proposals."""
    engine = make_engine(
        attention_backend="sdpa",
        max_num_batched_tokens=48,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
    )
    engine.runner.flashinfer = flashinfer_for(engine.runner)
    prompts = quoting(make_prompts(tiny_llama_dir, shared_prefix=40))[:8]
    got = run_all(engine, prompts)
    for index, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf_tiny_llama.generate(
                torch.tensor([prompt]), max_new_tokens=GREEDY_NEW_TOKENS, do_sample=False
            )
        assert got[str(index)] == out[0, len(prompt) :].tolist(), f"prompt {index}"
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.spec_decode_accepted_tokens > 0
