"""Weight storage formats, dequantised on the fly into the compute dtype.

- dense: the weight in the compute dtype (`none`) or stored in bfloat16 (`bf16`);
- int8: symmetric, one float16 scale per output channel;
- int4: symmetric, one float16 scale per group of 128 input channels, two values per byte.

Every format supports `rows(ids)` so a tied embedding and lm_head share one quantised matrix:
an output channel of the lm_head is a row of the embedding.
"""

from __future__ import annotations

import torch

from kvpilot.runtime.memory import INT4_GROUP_SIZE

INT8_MAX = 127
INT4_MAX = 7  # symmetric range [-7, 7]; -8 unused so that scale = absmax / 7 keeps zero exact


class Weight:
    """Stores a [out_features, in_features] matrix; dequantises to the compute dtype."""

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def num_bytes(self) -> int:
        raise NotImplementedError


class DenseWeight(Weight):
    def __init__(self, weight: torch.Tensor, storage_dtype: torch.dtype) -> None:
        self.weight = weight.to(storage_dtype).contiguous()  # [out, in]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight[ids].to(dtype)

    def num_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int8Weight(Weight):
    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.float()  # [out, in]
        scale = (w.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp(min=1e-8).half()  # [out, 1]
        self.qweight = torch.round(w / scale.float()).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        self.scale = scale

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.qweight.to(dtype) * self.scale.to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.qweight[ids].to(dtype) * self.scale[ids].to(dtype)

    def num_bytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 2


class Int4Weight(Weight):
    def __init__(self, weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> None:
        out_features, in_features = weight.shape
        num_groups = -(-in_features // group_size)
        # Zero-pad the input dimension to whole groups (e.g. 688 -> 768); padding dequantises to 0.
        w = torch.zeros(out_features, num_groups * group_size, device=weight.device)
        w[:, :in_features] = weight.float()
        groups = w.view(out_features, num_groups, group_size)
        scale = (groups.abs().amax(dim=2, keepdim=True) / INT4_MAX).clamp(min=1e-8).half()
        q = torch.round(groups / scale.float()).clamp(-INT4_MAX, INT4_MAX).to(torch.int16) + 8
        q = q.view(out_features, -1).to(torch.uint8)  # [out, in_padded], values 1..15
        self.packed = q[:, 0::2] | (q[:, 1::2] << 4)  # [out, in_padded / 2]
        self.scale = scale.squeeze(2)  # [out, num_groups]
        self.in_features = in_features
        self.group_size = group_size

    def _unpack(
        self, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        low = (packed & 0x0F).to(dtype) - 8
        high = (packed >> 4).to(dtype) - 8
        q = torch.stack((low, high), dim=-1).flatten(-2)  # [rows, in_padded]
        q = q.unflatten(-1, (-1, self.group_size)) * scale.to(dtype).unsqueeze(-1)
        return q.flatten(-2)[..., : self.in_features]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._unpack(self.packed, self.scale, dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._unpack(self.packed[ids], self.scale[ids], dtype)

    def num_bytes(self) -> int:
        return self.packed.numel() + self.scale.numel() * 2


def make_weight(weight: torch.Tensor, quantization: str, dtype: torch.dtype) -> Weight:
    """Store a checkpoint matrix in the format of a quantisation level."""
    if quantization == "none":
        return DenseWeight(weight, dtype)
    if quantization == "bf16":
        return DenseWeight(weight, torch.bfloat16)
    if quantization == "int8":
        return Int8Weight(weight)
    if quantization == "int4":
        return Int4Weight(weight)
    raise ValueError(f"quantization must be one of none, bf16, int8, int4, got {quantization!r}")
