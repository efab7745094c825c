"""KV-cache storage (`--kv-cache-dtype`): the model dtype, a 16-bit dtype, or fp8 with a scale.

A layer's keys (and its values) live in one `PagedCache`: [num_blocks, BLOCK_SIZE, H_kv, D] in the
storage dtype. fp8 is `float8_e4m3fn` holding value / scale with one scale per tensor (per layer,
for K and for V). Attention always runs in the model dtype: a write quantises, a read dequantises
the gathered blocks, so the pool holds twice the tokens of a 16-bit one and no kernel sees fp8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# The fp8 scale is fixed at 1.0, as vLLM's default k_scale/v_scale for checkpoints without
# scales, rather than calibrated at load. e4m3's relative precision is the same anywhere in its
# normal range (2^-6 .. 448), so any scale that keeps |K|, |V| inside it is as good as another;
# Llama-family K/V sit well inside at 1.0. On tiny-llama (|K|, |V| <= 10) `bench.engine_kv_dtype`
# measured scale 1.0 against amax/448 calibrated on a 512-token warm-up: K/V relative RMS error
# 2.65% vs 2.66%, KL to the fp32-KV next-token distribution 2.2e-4 vs 2.5e-4, perplexity +0.03%
# vs +0.00% (rounding noise). Calibration would cost a forward pass at load and depend on its
# text for no measured gain; a scale too small to hold amax (0.01 here) costs +0.7% perplexity.
DEFAULT_FP8_SCALE = 1.0
KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PagedCache:
    """One layer's keys or values. data: [num_blocks, BLOCK_SIZE, H_kv, D]; stored = x / scale."""

    data: torch.Tensor
    scale: float = DEFAULT_FP8_SCALE

    def write(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """x: [T, H_kv, D] in the model dtype, stored at its slots."""
        flat = self.data.view(-1, *self.data.shape[2:])  # [num_slots, H_kv, D]
        stored = quantize(x, self.data.dtype, self.scale)
        if is_fp8(self.data.dtype):  # index_copy_ has no fp8 kernel on CPU; bytes are bytes
            flat, stored = flat.view(torch.uint8), stored.view(torch.uint8)
        flat.index_copy_(0, slot_mapping, stored)

    def gather(self, block_ids: torch.Tensor, num_seqs: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_seqs * max_blocks] block ids -> [num_seqs, H_kv, L, D] in `dtype`.

        index_select copies whole blocks; on CPU it is about 1.5x faster than advanced indexing.
        Dequantising after the gather touches only this step's blocks."""
        if is_fp8(self.data.dtype):  # copy bytes, as `write` does: no fp8 kernel needed
            raw = self.data.view(torch.uint8).index_select(0, block_ids)
            gathered = raw.view(self.data.dtype)  # [num_seqs * max_blocks, BS, H_kv, D]
        else:
            gathered = self.data.index_select(0, block_ids)
        gathered = dequantize(gathered, dtype, self.scale)
        return gathered.view(num_seqs, -1, *self.data.shape[2:]).transpose(1, 2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == getattr(torch, "float8_e4m3fn", None)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x in the model dtype -> storage dtype. fp8 saturates at ±448 instead of overflowing to NaN
    (older torch casts out-of-range values to NaN)."""
    if not is_fp8(dtype):
        return x.to(dtype)  # a no-op when storage is the model dtype
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(stored: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Storage dtype -> `dtype`; the scale applies to fp8 only, as in `quantize`."""
    if not is_fp8(stored.dtype) or scale == 1.0:
        return stored.to(dtype)
    return stored.to(dtype).mul_(scale)


def fp8_scale(amax: float, headroom: float = 1.0) -> float:
    """The per-tensor scale that maps |x| <= amax x headroom onto fp8's ±448; 1.0 when amax is 0
    (a tensor of zeros, nothing to scale)."""
    if amax < 0 or headroom <= 0:
        raise ValueError(f"amax must be >= 0 and headroom > 0, got {amax}, {headroom}")
    return amax * headroom / FP8_MAX if amax > 0 else 1.0


def resolve_kv_cache_dtype(
    name: str, model_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """`--kv-cache-dtype` -> the storage dtype; ValueError where torch or the device cannot."""
    if name == "auto":
        return model_dtype
    if name in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[name]
    if name != "fp8":
        raise ValueError(f"--kv-cache-dtype must be one of auto, bf16, fp16, fp8, got {name!r}")
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        raise ValueError(
            f"--kv-cache-dtype fp8 needs torch.float8_e4m3fn, which torch {torch.__version__} "
            "lacks; use --kv-cache-dtype auto (or bf16/fp16), or torch >= 2.1"
        )
    check_fp8_round_trip(fp8, device)
    return fp8


def check_fp8_round_trip(fp8: torch.dtype, device: torch.device) -> None:
    """Every fp8 operation the cache uses, on a few values on the device, at start-up: a device
    whose torch build lacks one fails here with a clear message, not deep inside a decode step.

    No fp8 arithmetic runs (casts and byte copies only), so fp8 KV needs no fp8 tensor cores:
    any GPU this torch supports can hold it; the probe is the test of support."""
    try:
        cache = PagedCache(torch.zeros(2, 2, 1, 4, dtype=fp8, device=device), scale=0.5)
        values = [-4.0, -2.0, -1.0, -0.5, 0.5, 1.0, 2.0, 4.0]  # exact in fp8 at scale 0.5
        x = torch.tensor(values, device=device).view(2, 1, 4)
        cache.write(x, torch.tensor([1, 2], device=device))
        back = cache.gather(torch.tensor([0, 1], device=device), 1, torch.float32)
        is_ok = bool(torch.equal(back.transpose(1, 2).reshape(-1, 4)[1:3], x.view(2, 4)))
    except (RuntimeError, NotImplementedError, TypeError) as error:
        raise ValueError(
            f"--kv-cache-dtype fp8 is not supported on {device} by torch {torch.__version__} "
            f"({type(error).__name__}: {str(error).splitlines()[0]}); "
            "use --kv-cache-dtype auto (or bf16/fp16)"
        ) from None
    if not is_ok:
        raise ValueError(
            f"--kv-cache-dtype fp8 does not round-trip exactly on {device}; "
            "use --kv-cache-dtype auto (or bf16/fp16)"
        )


def allocate(
    num_layers: int,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    scales: list[tuple[float, float]] | None = None,
) -> list[tuple[PagedCache, PagedCache]]:
    """Per layer (keys, values) of `shape` [num_blocks, BLOCK_SIZE, H_kv, D]; scales per layer
    (k_scale, v_scale), DEFAULT_FP8_SCALE when not given (unused unless the dtype is fp8)."""
    scales = scales or [(DEFAULT_FP8_SCALE, DEFAULT_FP8_SCALE)] * num_layers
    if len(scales) != num_layers:
        raise ValueError(f"{len(scales)} KV scales for {num_layers} layers")
    return [
        (
            PagedCache(torch.zeros(shape, dtype=dtype, device=device), k_scale),
            PagedCache(torch.zeros(shape, dtype=dtype, device=device), v_scale),
        )
        for k_scale, v_scale in scales
    ]
