"""Paged attention against a plain per-sequence reference (both decode backends: the gather and
SDPA, and the CPU kernel that reads the pool in place), the kernel's own checks, the backend
choice (FlashInfer's too), and the runner's batch layout: decode groups cut by padded size, slot
ids a block at a time, rotary halves swapped exactly."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.model_runner import (
    ModelRunner,
    batch_layout,
    decode_group_bounds,
    load_model,
    plan_step,
    slot_ids,
)
from kvpilot.runtime.engine.scheduler import ScheduledSequence
from kvpilot.runtime.engine.sequence import Sequence
from kvpilot.runtime.layers import paged_kernel
from kvpilot.runtime.layers.attention import (
    AttentionMetadata,
    paged_attention,
    resolve_attention_backend,
)
from kvpilot.runtime.layers.kv_cache import dequantize, quantize
from kvpilot.runtime.layers.rotary import apply_rotary, signed_sin
from kvpilot.runtime.models.loader import load_model_config

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

NUM_BLOCKS = 64


@pytest.mark.parametrize(
    ("num_blocks", "max_group_blocks", "max_group_seqs", "expected"),
    [
        ([], 8, 16, []),
        ([1, 1, 1], 8, 16, [(0, 3)]),
        ([1, 1, 2, 2], 4, 16, [(0, 2), (2, 4)]),  # 3 x 2 blocks would pad to 6 > 4
        ([1, 3, 9], 4, 16, [(0, 1), (1, 2), (2, 3)]),  # a 9-block decode goes over alone
        ([1, 1, 1, 1, 1], 100, 2, [(0, 2), (2, 4), (4, 5)]),  # the sequence cap (CUDA)
    ],
)
def test_decode_group_bounds(
    num_blocks: list[int],
    max_group_blocks: int,
    max_group_seqs: int,
    expected: list[tuple[int, int]],
) -> None:
    assert decode_group_bounds(num_blocks, max_group_blocks, max_group_seqs) == expected


@pytest.mark.parametrize(
    ("block_table", "first", "end"),
    [([5], 0, 1), ([5, 2], 3, 20), ([7, 1, 4], 0, 48), ([7, 1, 4], 16, 17), ([3, 9, 8], 15, 33)],
)
def test_slot_ids_equal_per_token_arithmetic(block_table: list[int], first: int, end: int) -> None:
    expected = [
        block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(first, end)
    ]
    assert slot_ids(block_table, first, end) == expected


def test_batch_layout_puts_decodes_first_by_length() -> None:
    def item(name: str, num_computed: int, num_new: int) -> ScheduledSequence:
        seq = Sequence(name, list(range(num_computed + num_new)))
        seq.num_computed_tokens = num_computed
        return ScheduledSequence(seq, num_new)

    batch = [item("p1", 0, 9), item("d30", 30, 1), item("p2", 16, 4), item("d5", 5, 1)]
    assert [i.seq.request_id for i in batch_layout(batch)] == ["d5", "d30", "p1", "p2"]


def test_batch_layout_puts_one_adapters_prefill_chunks_side_by_side() -> None:
    """Chunks by LoRA slot, the base model's first, else in batch order: a slot's chunks make
    one run of rows (layers/lora_groups.slot_runs). Decode rows keep their length order."""
    batch: list[ScheduledSequence] = []
    for name, slot, num_new in [("a", 1, 9), ("d", 1, 1), ("b", 0, 4), ("c", 1, 5), ("e", -1, 3)]:
        seq = Sequence(name, list(range(num_new + 2)))
        seq.num_computed_tokens, seq.lora_slot = 2, slot
        batch.append(ScheduledSequence(seq, num_new))
    assert [i.seq.request_id for i in batch_layout(batch)] == ["d", "e", "b", "a", "c"]


def test_plan_of_reordered_chunks_samples_in_batch_order_with_each_rows_slot() -> None:
    batch: list[ScheduledSequence] = []
    for name, slot, num_tokens in [("a", 1, 3), ("b", 0, 2), ("c", -1, 4)]:
        seq = Sequence(name, list(range(10 * len(batch), 10 * len(batch) + num_tokens)))
        seq.block_table, seq.lora_slot = [len(batch)], slot
        batch.append(ScheduledSequence(seq, num_tokens))  # a whole prompt: it samples
    plan = plan_step(batch)  # rows: c (4), b (2), a (3)
    assert plan.input_ids == [20, 21, 22, 23, 10, 11, 0, 1, 2]
    assert plan.lora_slots == [-1] * 4 + [0] * 2 + [1] * 3
    assert plan.sample_rows == [8, 5, 3]  # each one's last row, in batch order: a, b, c


def test_proposals_become_decode_rows_with_growing_context() -> None:
    """A decode with two proposals is three decode rows (context 6, 7, 8), sorted among the
    plain decodes by context length, and all three are sampled, in order."""
    spec = Sequence("s", list(range(6)))
    spec.num_computed_tokens, spec.block_table, spec.draft_token_ids = 5, [3], [40, 41]
    plain = Sequence("d", list(range(8)))
    plain.num_computed_tokens, plain.block_table = 7, [9]
    plan = plan_step([ScheduledSequence(spec, 3, 2), ScheduledSequence(plain, 1)])
    assert plan.input_ids == [5, 40, 41, 7]
    assert plan.positions == [5, 6, 7, 7]
    assert plan.decode_context_lens == [6, 7, 8, 8]
    assert plan.slot_mapping == [3 * BLOCK_SIZE + 5, 3 * BLOCK_SIZE + 6, 3 * BLOCK_SIZE + 7,
                                 9 * BLOCK_SIZE + 7]  # fmt: skip
    assert plan.sample_rows == [0, 1, 2, 3] and plan.prefills == []


def test_signed_sin_rotary_is_bit_identical_to_rotate_half() -> None:
    torch.manual_seed(0)
    x, cos, sin = torch.randn(7, 10, 32), torch.randn(7, 32), torch.randn(7, 32)
    rotated = torch.cat((-x[..., 16:], x[..., :16]), dim=-1)  # transformers' rotate_half
    expected = x * cos[:, None, :] + rotated * sin[:, None, :]
    assert torch.equal(apply_rotary(x, cos, signed_sin(sin)), expected)


def reference_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: Sequence, num_new: int
) -> torch.Tensor:
    """q: [T, H, D] for positions [ctx - T, ctx) of `seq` -> [T, H, D], one head at a time."""
    num_context = seq.num_computed_tokens + num_new
    slots = torch.tensor(slot_ids(seq.block_table, 0, num_context))
    keys = k_cache.flatten(0, 1)[slots]  # [ctx, H_kv, D]
    values = v_cache.flatten(0, 1)[slots]
    group = q.shape[1] // keys.shape[1]
    out = torch.empty_like(q)
    for head in range(q.shape[1]):
        scores = q[:, head] @ keys[:, head // group].T * q.shape[-1] ** -0.5  # [T, ctx]
        visible = torch.ones(num_new, num_context, dtype=torch.bool).tril(num_context - num_new)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[:, head] = scores.softmax(-1) @ values[:, head // group]
    return out


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> ModelRunner:
    cfg = load_model_config(tiny_llama_dir)
    model = load_model(tiny_llama_dir, cfg, "none", torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, torch.device("cpu"), seed=0)
    runner.allocate_kv_cache(NUM_BLOCKS)
    return runner


def scheduled(contexts: list[tuple[int, int]]) -> list[ScheduledSequence]:
    """(num_computed, num_new) per sequence, on distinct shuffled blocks."""
    free = list(range(NUM_BLOCKS))
    random.Random(0).shuffle(free)
    batch = []
    for index, (num_computed, num_new) in enumerate(contexts):
        seq = Sequence(str(index), list(range(num_computed + num_new)))
        seq.num_computed_tokens = num_computed
        num_blocks = -(-(num_computed + num_new) // BLOCK_SIZE)
        seq.block_table, free = free[:num_blocks], free[num_blocks:]
        batch.append(ScheduledSequence(seq, num_new))
    return batch


@pytest.fixture(scope="module")
def kernel() -> None:
    """The CPU kernel, built (or loaded from the cache) once; a machine without a C++ compiler
    fails here with the reason, rather than skipping what the default backend runs."""
    paged_kernel.load()


@pytest.mark.parametrize(
    ("backend", "decode_group_limits"),
    [
        ("sdpa", (10**6, 10**6)),
        ("sdpa", (4, 16)),
        ("sdpa", (1, 1)),
        ("sdpa", (10**6, 3)),
        ("paged", (4, 16)),
    ],
    ids=["one-group", "by-padded-size", "one-per-group", "by-count", "paged-kernel"],
)
def test_paged_attention_matches_reference(
    runner: ModelRunner, kernel: None, backend: str, decode_group_limits: tuple[int, int]
) -> None:
    """Decodes of many lengths (split into groups of different widths, or all in one kernel
    call) and prefill chunks, with and without cached context, in one step."""
    torch.manual_seed(0)
    runner.attention_backend = backend
    runner.decode_group_limits = decode_group_limits
    for k_cache, v_cache in runner.kv_caches:
        k_cache.data.normal_(), v_cache.data.normal_()
    contexts = [(40, 1), (0, 1), (16, 1), (3, 1), (0, 12), (33, 1), (20, 7), (15, 1), (63, 1)]
    batch = scheduled(contexts)
    _, _, meta, _ = runner.prepare(batch)
    if backend == "paged":
        assert not meta.decodes and meta.paged_decodes is not None
        assert meta.paged_decodes.num_seqs == 7  # every decode row in one call
    else:
        assert meta.paged_decodes is None
        assert len(meta.decodes) > 1 or decode_group_limits[0] == 10**6
    cfg = runner.model.cfg
    num_tokens = sum(num_new for _, num_new in contexts)
    q = torch.randn(num_tokens, cfg.num_heads, cfg.head_dim)
    k, v = torch.randn(2, num_tokens, cfg.num_kv_heads, cfg.head_dim).unbind(0)
    k_cache, v_cache = runner.kv_caches[0]
    out = paged_attention(q, k, v, k_cache, v_cache, meta, cfg.head_dim**-0.5)
    start = 0
    for item in batch_layout(batch):
        rows = slice(start, start + item.num_new_tokens)
        expected = reference_attention(
            q[rows], k_cache.data, v_cache.data, item.seq, item.num_new_tokens
        )
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
        start += item.num_new_tokens


def test_chunk_over_cached_kv_needs_its_mask(runner: ModelRunner) -> None:
    runner.attention_backend = "sdpa"
    batch = scheduled([(16, 4)])
    _, _, meta, _ = runner.prepare(batch)
    meta = AttentionMetadata(meta.slot_mapping, [], [meta.prefills[0]])
    meta.prefills[0].mask = None
    q, k, v = torch.randn(4, 8, 32), torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    k_cache, v_cache = runner.kv_caches[0]
    with pytest.raises(ValueError, match="needs its mask"):
        paged_attention(q, k, v, k_cache, v_cache, meta, 1.0)


def test_paged_attention_reads_fp8_through_its_scales(tiny_llama_dir: Path) -> None:
    """Decodes and chunks over cached context read fp8 keys and values dequantised with their
    own scales: the same output as attention over the dequantised cache (to 1e-4, as the values
    are ~4x larger than in the float32 test)."""
    cfg = load_model_config(tiny_llama_dir)
    model = load_model(tiny_llama_dir, cfg, "none", torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, torch.device("cpu"), seed=0)
    runner.allocate_kv_cache(NUM_BLOCKS, torch.float8_e4m3fn, [(0.05, 0.2)] * cfg.num_layers)
    torch.manual_seed(0)
    k_cache, v_cache = runner.kv_caches[0]
    for cache in (k_cache, v_cache):
        fresh = torch.randn(cache.data.shape) * 4
        cache.data.copy_(quantize(fresh, cache.data.dtype, cache.scale))
    contexts = [(40, 1), (0, 1), (16, 1), (20, 7), (63, 1), (5, 12)]  # no chunk without context
    batch = scheduled(contexts)
    _, _, meta, _ = runner.prepare(batch)
    num_tokens = sum(num_new for _, num_new in contexts)
    q = torch.randn(num_tokens, cfg.num_heads, cfg.head_dim)
    k, v = (torch.randn(2, num_tokens, cfg.num_kv_heads, cfg.head_dim) * 4).unbind(0)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, cfg.head_dim**-0.5)
    keys = dequantize(k_cache.data, torch.float32, k_cache.scale)  # after this step's writes
    values = dequantize(v_cache.data, torch.float32, v_cache.scale)
    assert not torch.equal(keys, dequantize(k_cache.data, torch.float32, 1.0))  # scales count
    start = 0
    for item in batch_layout(batch):
        rows = slice(start, start + item.num_new_tokens)
        expected = reference_attention(q[rows], keys, values, item.seq, item.num_new_tokens)
        torch.testing.assert_close(out[rows], expected, atol=1e-4, rtol=1e-4)
        start += item.num_new_tokens


def kernel_inputs(
    dtype: torch.dtype, lengths: list[int], num_heads: int = 8, num_kv_heads: int = 2, dim: int = 64
) -> tuple[torch.Tensor, ...]:
    """q [B, H, D] (a strided view, as the model hands it over), a pool of shuffled blocks and
    block tables padded with block 0."""
    generator = torch.Generator().manual_seed(0)
    widths = [-(-length // BLOCK_SIZE) for length in lengths]
    blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables = torch.zeros(len(lengths), max(widths), dtype=torch.int32)
    for row, width in enumerate(widths):
        tables[row, :width] = torch.tensor(blocks[:width])
        blocks = blocks[width:]
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    wide = torch.randn(len(lengths), num_heads + num_kv_heads, dim, generator=generator)
    q = wide.to(dtype)[:, :num_heads]  # not contiguous: rows of H + H_kv heads
    return q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32)


def kernel_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    out = torch.empty(q.shape)
    group = q.shape[1] // k_cache.shape[2]
    for row, length in enumerate(lengths.tolist()):
        slots = [
            int(tables[row, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)
        ]
        keys = k_cache.flatten(0, 1)[slots].float()  # [ctx, H_kv, D]
        values = v_cache.flatten(0, 1)[slots].float()
        for head in range(q.shape[1]):
            scores = keys[:, head // group] @ q[row, head].float() * q.shape[-1] ** -0.5
            out[row, head] = scores.softmax(-1) @ values[:, head // group]
    return out


@pytest.mark.parametrize(
    ("dtype", "dim", "tolerance"),
    [
        (torch.float32, 64, 1e-5),
        (torch.bfloat16, 64, 2e-2),  # the output is rounded to bf16 (8 bits of mantissa)
        (torch.bfloat16, 32, 2e-2),
        (torch.float16, 32, 2e-3),
        (torch.float32, 48, 1e-5),  # a head size without its own specialisation
    ],
)
def test_kernel_matches_reference(
    kernel: None, dtype: torch.dtype, dim: int, tolerance: float
) -> None:
    """Lengths at, under and over block boundaries, one token to 100, in one call."""
    lengths = [1, 15, 16, 17, 33, 100, 64]
    q, k_cache, v_cache, tables, lens = kernel_inputs(dtype, lengths, dim=dim)
    out = paged_kernel.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    expected = kernel_reference(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "dim", "dtype"),
    [
        (8, 8, 64, torch.bfloat16),  # group 1: the values read once per head from the pool
        (8, 4, 128, torch.bfloat16),  # group 2 of 128-wide heads: 16 registers of sums
        (16, 2, 32, torch.float16),  # group 8 of 32-wide heads: 16 registers, fp16 values
        (16, 2, 64, torch.bfloat16),  # group 8 of 64-wide heads: too many sums, per head
        (12, 4, 64, torch.float32),  # group 3: no fused form, per head
        (8, 2, 128, torch.float32),  # group 4 of 128-wide heads: per head
    ],
)
def test_kernel_matches_reference_for_each_group(
    kernel: None, num_heads: int, num_kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    """Query heads per KV head take the fused path (every head's sums in registers, each value
    row read once) where they fit, the per-head path elsewhere: the same output either way."""
    lengths = [1, 16, 17, 50]
    q, k_cache, v_cache, tables, lens = kernel_inputs(dtype, lengths, num_heads, num_kv_heads, dim)
    out = paged_kernel.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5)
    expected = kernel_reference(q, k_cache, v_cache, tables, lens)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "dim", "dtype"),
    [
        (8, 2, 32, torch.bfloat16),  # the grouped bf16 scores (tiny-llama's shape)
        (16, 2, 64, torch.bfloat16),  # grouped scores, values per head
        (12, 4, 64, torch.float32),  # per head throughout
    ],
)
def test_kernel_reads_nothing_past_the_context(
    kernel: None, num_heads: int, num_kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    """Slots past a sequence's length hold whatever the pool held (here NaN): none of it may
    reach the output, through the scores, the softmax or the values."""
    lengths = [1, 5, 17, 40]
    q, k_cache, v_cache, tables, lens = kernel_inputs(dtype, lengths, num_heads, num_kv_heads, dim)
    expected = kernel_reference(q, k_cache, v_cache, tables, lens)
    for row, length in enumerate(lengths):  # the rest of the row's last block
        block = int(tables[row, (length - 1) // BLOCK_SIZE])
        k_cache[block, (length - 1) % BLOCK_SIZE + 1 :] = float("nan")
        v_cache[block, (length - 1) % BLOCK_SIZE + 1 :] = float("nan")
    out = paged_kernel.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda args: {**args, "lens": torch.tensor([0, 5], dtype=torch.int32)}, "outside 1.."),
        (lambda args: {**args, "lens": torch.tensor([5, 33], dtype=torch.int32)}, "outside 1.."),
        (lambda args: {**args, "tables": args["tables"] + NUM_BLOCKS}, "outside the pool"),
        (lambda args: {**args, "tables": args["tables"].long()}, "int32"),
        (lambda args: {**args, "k": args["k"].to(torch.bfloat16)}, "query's dtype"),
        (
            lambda args: {
                **args,
                "k": args["k"][:, :8].contiguous(),
                "v": args["v"][:, :8].contiguous(),
            },
            "16 tokens",
        ),
        (lambda args: {**args, "q": args["q"][:, :3]}, "multiple of H_kv"),
    ],
    ids=["empty", "past-table", "block-id", "int64-table", "kv-dtype", "block-size", "heads"],
)
def test_kernel_refuses_bad_input(kernel: None, change: Any, message: str) -> None:
    """A malformed call is a RuntimeError that names the problem, never a read outside the pool."""
    q, k_cache, v_cache, tables, lens = kernel_inputs(torch.float32, [5, 20])
    args = change({"q": q, "k": k_cache, "v": v_cache, "tables": tables, "lens": lens})
    with pytest.raises(RuntimeError, match=message):
        paged_kernel.paged_decode_attention(
            args["q"], args["k"], args["v"], args["tables"], args["lens"], 0.125
        )


def ready() -> str | None:
    return None


def no_compiler() -> str:
    return "no C++ compiler"


def no_flashinfer() -> str:
    return "flashinfer-python does not import"


@pytest.mark.parametrize(
    ("choice", "device", "kv_in_model_dtype", "kernel_error", "flashinfer_error", "expected"),
    [
        ("auto", "cpu", True, ready, ready, "paged"),  # FlashInfer is not asked on a CPU
        ("auto", "cpu", True, no_compiler, ready, "sdpa"),
        ("auto", "cpu", False, ready, ready, "sdpa"),  # fp8 KV: the kernel reads the model dtype
        ("paged", "cpu", True, ready, ready, "paged"),
        ("sdpa", "cpu", True, ready, ready, "sdpa"),
        ("auto", "cuda", True, ready, ready, "flashinfer"),
        ("auto", "cuda", True, ready, no_flashinfer, "sdpa"),
        ("auto", "cuda", False, ready, ready, "flashinfer"),  # fp8 KV: FlashInfer reads it
        ("flashinfer", "cuda", True, ready, ready, "flashinfer"),
        ("sdpa", "cuda", True, no_compiler, ready, "sdpa"),
    ],
)
def test_resolve_attention_backend(
    choice: str,
    device: str,
    kv_in_model_dtype: bool,
    kernel_error: Any,
    flashinfer_error: Any,
    expected: str,
) -> None:
    backend, why = resolve_attention_backend(
        choice, torch.device(device), kv_in_model_dtype, kernel_error, flashinfer_error
    )
    assert backend == expected and why
    if choice == "auto" and expected == "sdpa" and kv_in_model_dtype:  # the log says why
        reason = (kernel_error if device == "cpu" else flashinfer_error)()
        assert reason in why


@pytest.mark.parametrize(
    ("choice", "device", "kv_in_model_dtype", "kernel_error", "flashinfer_error", "message"),
    [
        ("paged", "cuda", True, ready, ready, "is a CPU kernel"),
        ("paged", "cpu", False, ready, ready, "--kv-cache-dtype fp8"),
        ("paged", "cpu", True, no_compiler, ready, "no C\\+\\+ compiler"),
        ("flashinfer", "cpu", True, ready, ready, "runs FlashInfer's CUDA kernels"),
        ("flashinfer", "cuda", True, ready, no_flashinfer, "does not import"),
    ],
)
def test_a_backend_asked_for_where_it_cannot_run(
    choice: str,
    device: str,
    kv_in_model_dtype: bool,
    kernel_error: Any,
    flashinfer_error: Any,
    message: str,
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_attention_backend(
            choice, torch.device(device), kv_in_model_dtype, kernel_error, flashinfer_error
        )


def test_a_machine_without_a_compiler_gets_the_reason_and_the_fallback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The build stops before torch's extension builder with a line that says what to do."""
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(paged_kernel.KernelUnavailableError, match="--attention-backend sdpa"):
        paged_kernel._build_and_load(tmp_path, paged_kernel.COMPILE_FLAGS)
