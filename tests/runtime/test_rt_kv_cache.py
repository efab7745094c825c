"""KV-cache storage (layers/kv_cache.py): round trips per storage dtype and scale, the fp8 scale
arithmetic, dtype resolution and its errors, and agreement with the planner's bytes per value."""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot.contract import memory
from kvpilot.runtime.layers import kv_cache
from kvpilot.runtime.layers.kv_cache import FP8_MAX, PagedCache, fp8_scale, resolve_kv_cache_dtype

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
SHAPE = (6, 16, 2, 8)  # [num_blocks, BLOCK_SIZE, H_kv, D]


@pytest.mark.parametrize(
    ("amax", "headroom", "expected"),
    [(448.0, 1.0, 1.0), (8.96, 1.0, 0.02), (10.0, 2.0, 20 / 448), (0.0, 1.0, 1.0)],
)
def test_fp8_scale_maps_amax_onto_the_fp8_range(
    amax: float, headroom: float, expected: float
) -> None:
    assert fp8_scale(amax, headroom) == pytest.approx(expected)


@pytest.mark.parametrize(("amax", "headroom"), [(-1.0, 1.0), (1.0, 0.0)])
def test_fp8_scale_rejects_bad_input(amax: float, headroom: float) -> None:
    with pytest.raises(ValueError, match="amax must be >= 0"):
        fp8_scale(amax, headroom)


def write_and_read(dtype: torch.dtype, scale: float, x: torch.Tensor) -> torch.Tensor:
    """x: [T, H_kv, D] written at shuffled slots, gathered back through its block table."""
    cache = PagedCache(torch.zeros(SHAPE, dtype=dtype), scale)
    blocks = list(range(SHAPE[0]))
    random.Random(0).shuffle(blocks)
    num_blocks = -(-x.shape[0] // SHAPE[1])
    table = torch.tensor(blocks[:num_blocks])
    slots = (table[:, None] * SHAPE[1] + torch.arange(SHAPE[1])).flatten()[: x.shape[0]]
    cache.write(x, slots)
    back = cache.gather(table, 1, torch.float32)  # [1, H_kv, L, D]
    return back[0].transpose(0, 1)[: x.shape[0]]  # [T, H_kv, D]


@pytest.mark.parametrize(
    ("dtype", "scale", "magnitude", "rtol"),
    [
        (torch.float32, 1.0, 5.0, 0.0),  # auto on CPU: exact
        (torch.bfloat16, 1.0, 5.0, 2**-8),
        (torch.float16, 1.0, 5.0, 2**-11),
        (FP8, 1.0, 5.0, 2**-4),  # 3 mantissa bits: half a step is 2^-4 relative
        (FP8, 0.02, 5.0, 2**-4),  # a calibrated-like scale: the same relative precision
        (FP8, 1.0, 2000.0, 2**-4),  # beyond 448 only with a scale that makes room
    ],
)
def test_round_trip_precision(
    dtype: torch.dtype, scale: float, magnitude: float, rtol: float
) -> None:
    torch.manual_seed(0)
    sign = torch.randint(0, 2, (40, 2, 8)) * 2 - 1
    x = sign * magnitude * torch.empty(40, 2, 8).uniform_(0.05, 1.0)  # normal range, no zeros
    if magnitude > FP8_MAX:
        scale = fp8_scale(magnitude)
    back = write_and_read(dtype, scale, x)
    assert torch.all((back - x).abs() <= rtol * 1.0001 * x.abs())


def test_fp8_saturates_instead_of_overflowing() -> None:
    values = [1000.0, -1000.0, 3.0, 0.0, 448.0, -500.0, 0.5, 1e9]
    x = torch.tensor(values).view(1, 1, 8).expand(1, 2, 8)
    back = write_and_read(FP8, 1.0, x.contiguous())
    assert back[0, 0].tolist() == [FP8_MAX, -FP8_MAX, 3.0, 0.0, FP8_MAX, -FP8_MAX, 0.5, FP8_MAX]


def test_a_scale_only_applies_to_fp8() -> None:
    x = torch.full((3, 2, 8), 1.5)
    assert torch.equal(write_and_read(torch.bfloat16, 0.25, x), x)
    assert torch.equal(write_and_read(FP8, 0.25, x), x)  # 6.0 stored, exact in fp8


@pytest.mark.parametrize(
    ("name", "model_dtype", "expected"),
    [
        ("auto", torch.float32, torch.float32),
        ("auto", torch.bfloat16, torch.bfloat16),
        ("bf16", torch.float32, torch.bfloat16),
        ("fp16", torch.float32, torch.float16),
        ("fp16", torch.bfloat16, torch.float16),
        ("fp8", torch.bfloat16, FP8),
    ],
)
def test_resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, expected: torch.dtype) -> None:
    assert resolve_kv_cache_dtype(name, model_dtype, CPU) == expected


@pytest.mark.parametrize(("name", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_kv_bytes_agree_with_the_planner(name: str, dtype: torch.dtype) -> None:
    """The operator's planner sizes KV with memory.kv_dtype_bytes; the runtime with the storage
    dtype's element size. They must be the same number, fp8 included."""
    stored = resolve_kv_cache_dtype(name, torch.float32, CPU)
    assert stored == dtype
    assert stored.itemsize == memory.kv_dtype_bytes(name)
    assert resolve_kv_cache_dtype("fp8", torch.float32, CPU).itemsize == memory.kv_dtype_bytes(
        "fp8"
    )


def test_fp8_without_torch_support_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(
        ValueError, match=r"--kv-cache-dtype fp8 needs torch\.float8_e4m3fn"
    ) as info:
        resolve_kv_cache_dtype("fp8", torch.bfloat16, CPU)
    assert "use --kv-cache-dtype auto" in str(info.value) and "\n" not in str(info.value)


def test_fp8_without_a_device_kernel_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernel(*args: object) -> None:
        raise RuntimeError("\"index_copy_cuda\" not implemented for 'Byte'\nmore detail")

    monkeypatch.setattr(PagedCache, "write", no_kernel)
    with pytest.raises(ValueError, match="fp8 is not supported on cpu") as info:
        resolve_kv_cache_dtype("fp8", torch.bfloat16, CPU)
    assert "use --kv-cache-dtype auto" in str(info.value) and "\n" not in str(info.value)


def test_allocate_checks_one_scale_pair_per_layer() -> None:
    caches = kv_cache.allocate(2, SHAPE, FP8, CPU, [(0.5, 0.25), (1.0, 2.0)])
    assert [(k.scale, v.scale) for k, v in caches] == [(0.5, 0.25), (1.0, 2.0)]
    assert all(k.data.dtype == FP8 and k.data.shape == SHAPE for k, _ in caches)
    with pytest.raises(ValueError, match="1 KV scales for 2 layers"):
        kv_cache.allocate(2, SHAPE, FP8, CPU, [(1.0, 1.0)])
