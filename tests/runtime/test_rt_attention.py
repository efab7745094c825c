"""Paged attention against a plain per-sequence reference, and the runner's batch layout:
decode groups cut by padded size, slot ids a block at a time, rotary halves swapped exactly."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvpilot.runtime.layers.attention import AttentionMetadata, paged_attention
from kvpilot.runtime.layers.kv_cache import dequantize, quantize
from kvpilot.runtime.layers.rotary import apply_rotary, signed_sin
from kvpilot.runtime.loader import load_model_config
from kvpilot.runtime.memory import BLOCK_SIZE
from kvpilot.runtime.model_runner import (
    ModelRunner,
    batch_layout,
    decode_group_bounds,
    load_model,
    plan_step,
    slot_ids,
)
from kvpilot.runtime.scheduler import ScheduledSequence
from kvpilot.runtime.sequence import Sequence

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


@pytest.mark.parametrize(
    "decode_group_limits",
    [(10**6, 10**6), (4, 16), (1, 1), (10**6, 3)],
    ids=["one-group", "by-padded-size", "one-per-group", "by-count"],
)
def test_paged_attention_matches_reference(
    runner: ModelRunner, decode_group_limits: tuple[int, int]
) -> None:
    """Decodes of many lengths (split into groups of different widths) and prefill chunks, with
    and without cached context, in one step."""
    torch.manual_seed(0)
    runner.decode_group_limits = decode_group_limits
    for k_cache, v_cache in runner.kv_caches:
        k_cache.data.normal_(), v_cache.data.normal_()
    contexts = [(40, 1), (0, 1), (16, 1), (3, 1), (0, 12), (33, 1), (20, 7), (15, 1), (63, 1)]
    batch = scheduled(contexts)
    _, _, meta, _ = runner.prepare(batch)
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
