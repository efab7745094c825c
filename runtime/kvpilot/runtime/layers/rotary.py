"""Rotary position embedding as transformers computes it (rotate-half), with Llama-3 scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)  # type: ignore[arg-type]
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r}; supported: default, linear, llama3"
    )


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_table(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_positions, head_dim] in float32."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """[..., D] -> sin with its first half negated, so that `apply_rotary` can swap the halves
    without negating one: (-x2) * s1 and x2 * (-s1) are the same float, so results stay
    bit-identical to transformers' rotate_half."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin_signed (see `signed_sin`): [T, D] already in x's dtype.

    x * cos + rotate_half(x) * sin, with two fresh tensors instead of five."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    out = x * cos[:, None, :]
    out += swapped.mul_(sin_signed[:, None, :])
    return out
