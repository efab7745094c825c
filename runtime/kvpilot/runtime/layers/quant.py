"""Weight storage formats and the matmul each runs, packed once at load.

- dense: the weight in the compute dtype (`none`) or stored in bfloat16 (`bf16`); `F.linear`,
  or on CPU for a decode step's one or two rows `torch.ops.kvpilot.dense_rows` (dense_rows.cpp).
- int8: symmetric, one scale per output channel. Two kernels over the same stored weights:
  `w8a16` keeps bf16 activations (`aten._weight_int8pack_mm`, CPU and CUDA); `w8a8` quantises
  each activation row to int8 at the step (its own scale, as llama.cpp's q8_0 does per block)
  and multiplies int8 by int8 in int32 (`torch._int_mm`, CPU only). `auto` picks w8a8 where the
  CPU has int8 dot products (VNNI, AMX): there the weight-only kernel widens every weight to
  fp32 before its FMA and runs slower than bf16 from a few rows up (docs/benchmarks.md).
- int4: asymmetric, a scale and a zero per group of 128 input channels, two values per byte;
  `aten._weight_int4pack_mm_for_cpu` on CPU, `aten._weight_int4pack_mm` (tinygemm) on CUDA.

The quantised matmuls never dequantise the matrix: each kernel reads the packed weights and
scales as they are, so a decode step moves half (int8) or a quarter (int4) of bf16's bytes.
Their activations, scales and zeros are bfloat16 (fp16 compute keeps fp16 for int8): under
float32 compute the activation is rounded to bfloat16 at the kernel's input and its output
returned in float32, because the float32 variant of the CPU kernels is not vectorised (7x slower
than bf16, docs/benchmarks.md).

Every format supports `rows(ids)` so a tied embedding and lm_head share one quantised matrix:
an output channel of the lm_head is a row of the embedding. `dequantize` is the reference the
kernels are tested against (and what `rows` returns for the rows asked), never the hot path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 - the torch convention

from kvpilot.contract.engine_config import INT8_KERNEL_CHOICES
from kvpilot.contract.memory import INT4_GROUP_SIZE
from kvpilot.runtime.layers import paged_kernel

INT8_MAX = 127
INT8_K_MULTIPLE = 16
INT4_LEVELS = 15  # values 0..15; the kernels dequantise (q - 8) * scale + zero
INT4_MID = 8
# The CPU int4 kernel packs BLOCK_N output channels as one tile (AVX512: 64 rows, AVX2: 32; the
# low nibble of byte j holds row j and the high nibble row j + BLOCK_N / 2, k by k); `Int4Weight`
# reads embedding rows straight from that tile, its height found once (`cpu_int4_tile_rows`).
CPU_INT4_TILE_ROWS = (64, 32)
CPU_QUANTIZE_BLOCK = 256 * 1024  # float32 values quantised at a time on CPU: 1 MiB, in L2
CUDA_INT4_INNER_K_TILES = 8  # tinygemm's widest inner tile; needs in_features % 128 == 0


class Weight:
    """Stores a [out_features, in_features] matrix and multiplies activations by its transpose."""

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in] -> x @ W.T (+ bias): [T, out] in x's dtype."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def num_bytes(self) -> int:
        raise NotImplementedError


class DenseWeight(Weight):
    def __init__(self, weight: torch.Tensor, storage_dtype: torch.dtype) -> None:
        self.weight = weight.to(storage_dtype).contiguous()  # [out, in]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] <= DENSE_ROWS_MAX and dense_rows_runs(x, self.weight):
            return torch.ops.kvpilot.dense_rows(x, self.weight, bias)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight[ids].to(dtype)

    def num_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


# A decode step's one or two rows on CPU run through torch.ops.kvpilot.dense_rows
# (layers/dense_rows.cpp), which reads each line of the weight once for both rows; F.linear
# (oneDNN) took 17.5 us for a 256 x 256 bf16 matrix at one row, dense_rows 3.6 us, and from 3-4
# rows on the larger matrices oneDNN's blocking wins (docs/benchmarks.md, engine_dense_rows).
DENSE_ROWS_MAX = 2
_DENSE_ROWS = True  # bench.engine_dense_rows turns it off for the side-by-side run


def dense_rows_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether dense_rows takes x [T, in] by `weight`: on CPU, where the kernel library is
    loaded (never built for this), for the dtypes it runs faster than F.linear. Asked for every
    projection of a step: the checks are attributes and a set lookup once the library is in."""
    if not (_DENSE_ROWS and x.is_cpu and x.dim() == 2 and x.stride(-1) == 1):
        return False
    return (x.dtype, weight.dtype) in (_DENSE_ROWS_PAIRS or _dense_rows_pairs())


# Filled once the library is loaded (an empty set: not yet, asked again next call).
_DENSE_ROWS_PAIRS: set[tuple[torch.dtype, torch.dtype]] = set()


def _dense_rows_pairs() -> set[tuple[torch.dtype, torch.dtype]]:
    """(activation, weight) dtypes dense_rows runs: float32 rows by a float32 or bf16 weight
    (F.linear would convert the whole bf16 matrix each call), bf16 by bf16 only where the
    library has AVX512-BF16's dot product; none while the library is not loaded."""
    if paged_kernel.loaded_without_building():
        _DENSE_ROWS_PAIRS.update({(torch.float32, torch.float32), (torch.float32, torch.bfloat16)})
        if torch.ops.kvpilot.dense_rows_bf16_dot():
            _DENSE_ROWS_PAIRS.add((torch.bfloat16, torch.bfloat16))
    return _DENSE_ROWS_PAIRS


def kernel_dtype(compute_dtype: torch.dtype, allow_fp16: bool) -> torch.dtype:
    """The activation dtype a quantised kernel runs in: bf16 unless fp16 compute and the kernel
    takes fp16 (the int8 one does; tinygemm int4 is bf16 only)."""
    return torch.float16 if allow_fp16 and compute_dtype == torch.float16 else torch.bfloat16


def _as_kernel_input(x: torch.Tensor, dtype: torch.dtype, padded_in: int) -> torch.Tensor:
    """x [T, in] in the kernel's dtype, contiguous, zero-padded to the packed input width."""
    x = x.to(dtype)
    if padded_in != x.shape[-1]:
        x = F.pad(x, (0, padded_in - x.shape[-1]))
    return x.contiguous()


def _finish(out: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    out = out.to(dtype)
    return out if bias is None else out + bias


class Int8Weight(Weight):
    def __init__(self, weight: torch.Tensor, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        w = weight.float()  # [out, in]
        self.kernel_dtype = kernel_dtype(compute_dtype, allow_fp16=True)
        # The scale is rounded to the kernel's dtype before quantising, so the stored values
        # are exactly what the kernel multiplies by (error within half a step per channel).
        scale = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-8).to(self.kernel_dtype)  # [out]
        q = torch.round(w / scale.float()[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        self._store(q, scale)

    @classmethod
    def from_parts(
        cls, q: torch.Tensor, scale: torch.Tensor, compute_dtype: torch.dtype
    ) -> Int8Weight:
        """int8 values [out, in] and scales [out] a checkpoint quantised already. The scale is
        rounded to the kernel's dtype (the checkpoint's is bf16 or float32)."""
        stored = cls.__new__(cls)
        stored.kernel_dtype = kernel_dtype(compute_dtype, allow_fp16=True)
        stored._store(q, scale.to(stored.kernel_dtype))
        return stored

    def _store(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        # The CPU kernel reads the input dimension 16 at a time (and returns garbage or crashes
        # on a remainder): pad it with zero weights, which the padded activations meet.
        self.in_features = q.shape[1]
        self.qweight = F.pad(q, (0, -self.in_features % INT8_K_MULTIPLE)).contiguous()
        self.scale = scale

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        xk = _as_kernel_input(x, self.kernel_dtype, self.qweight.shape[1])
        return _finish(
            torch.ops.aten._weight_int8pack_mm(xk, self.qweight, self.scale), x.dtype, bias
        )

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.rows(torch.arange(self.scale.shape[0], device=self.scale.device), dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        q = self.qweight[ids, : self.in_features]
        return (q.float() * self.scale[ids].float()[:, None]).to(dtype)

    def num_bytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * self.scale.element_size()


class Int8DynamicWeight(Weight):
    """The int8 level's `w8a8` kernel, CPU only: the stored int8 weights multiplied by int8
    activations, each activation row quantised at the step with its own scale (absmax / 127),
    `torch._int_mm` accumulating int8 x int8 in int32 (VNNI). A row's result depends on that row
    alone, never on the rest of the batch. bench.engine_quant measures it against the
    weight-only kernel on identical weights."""

    def __init__(self, weight: Int8Weight) -> None:
        if weight.qweight.device.type != "cpu":
            raise ValueError("Int8DynamicWeight runs on CPU only (CUDA's _int_mm needs M > 16)")
        self.weight = weight
        self.qweight_t = weight.qweight.t()  # [in, out], a view: no second copy
        self.scale = weight.scale.float()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x32 = x.float()
        x_scale = x32.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-8).div_(INT8_MAX)  # [T, 1]
        xq = x32.div(x_scale).round_().to(torch.int8)
        xq = _as_kernel_input(xq, torch.int8, self.qweight_t.shape[0])
        out = torch._int_mm(xq, self.qweight_t).float().mul_(x_scale).mul_(self.scale)
        return _finish(out, x.dtype, bias)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.dequantize(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.rows(ids, dtype)

    def num_bytes(self) -> int:
        return self.weight.num_bytes()


@dataclass(frozen=True)
class Int4Parts:
    """The int4 format before packing: values uint8 [out, in_padded] in 0..15, scale and zero
    bf16 [out, groups]; (q - 8) * scale + zero dequantises. `in_features` before padding."""

    values: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    in_features: int

    def to(self, device: torch.device) -> Int4Parts:
        values, scale, zero = (t.to(device) for t in (self.values, self.scale, self.zero))
        return Int4Parts(values, scale, zero, self.group_size, self.in_features)


def quantize_int4(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> q uint8 [out, in_padded] in 0..15, scale and zero bf16 [out, groups].

    The input dimension is zero-padded to whole groups (e.g. 688 -> 768). Asymmetric: each
    group's min..max spans the 16 levels, and (q - 8) * scale + zero dequantises, as tinygemm
    does. Scale and zero are rounded to bf16 first so quantising sees the kernel's numbers."""
    out_features, in_features = weight.shape
    num_groups = -(-in_features // group_size)
    padded = num_groups * group_size
    q = torch.empty(out_features, padded, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(out_features, num_groups, dtype=torch.bfloat16, device=weight.device)
    zero = torch.empty_like(scale)
    # On CPU, a block of rows at a time, in place: its float32 copy stays in the cache through
    # the eight elementwise passes (whole matrices went to memory and back in each: 10x slower,
    # most of an int4 start-up). A GPU takes the matrix at once.
    rows = max(1, CPU_QUANTIZE_BLOCK // padded) if weight.device.type == "cpu" else out_features
    for start in range(0, out_features, rows):
        block = slice(start, min(start + rows, out_features))
        w = torch.zeros(block.stop - start, padded, device=weight.device)
        w[:, :in_features] = weight[block]
        groups = w.view(-1, num_groups, group_size)
        low, high = groups.amin(dim=2), groups.amax(dim=2)
        scale[block] = ((high - low) / INT4_LEVELS).clamp_(min=1e-8)
        zero[block] = low + INT4_MID * scale[block].float()
        groups.sub_(zero[block].float()[..., None]).div_(scale[block].float()[..., None])
        q[block] = groups.round_().add_(INT4_MID).clamp_(0, INT4_LEVELS).view(-1, padded)
    return q, scale, zero


def _dequantize_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """q [rows, in_padded] (0..15), scale/zero [rows, groups] -> float32 [rows, in_padded]."""
    groups = (q.float() - INT4_MID).unflatten(-1, (-1, group_size))
    return (groups * scale.float()[..., None] + zero.float()[..., None]).flatten(-2)


@functools.cache
def cpu_int4_tile_rows() -> int | None:
    """The height of the tiles this process's CPU int4 kernel packs (its CPU capability picks the
    kernel, once per process), found by packing a probe matrix and reading it back; None when no
    layout we know reads it (an embedding then keeps its own copy of its rows). Once, not per
    matrix: checking each at load took a quarter of a 245 M int4 checkpoint's load time."""
    probe_rows = max(CPU_INT4_TILE_ROWS)
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, INT4_LEVELS + 1, (probe_rows, 256), generator=generator, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    ids = torch.arange(probe_rows)
    for tile_rows in CPU_INT4_TILE_ROWS:
        if torch.equal(_unpack_cpu_tiles(packed, ids, tile_rows), q):
            return tile_rows
    return None


def _pack_for_cpu(q: torch.Tensor) -> torch.Tensor:
    """q [out, in_padded] in 0..15 (uint8 or int32) -> the CPU kernel's packed matrix. Written
    straight into its tiles where their layout is known (one pass over bytes), else by the
    kernel's own packing op, which takes int32 values: a 4x wider copy of every matrix, its
    conversion and packing were most of an int4 checkpoint's load time."""
    tile_rows = cpu_int4_tile_rows()
    if tile_rows is None or q.shape[0] % tile_rows or q.shape[1] % 2:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    return _pack_cpu_tiles(q.to(torch.uint8), tile_rows)


def _pack_cpu_tiles(q: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """uint8 [out, in] in 0..15, in either memory order -> the kernel's tiles (see
    _unpack_cpu_tiles), [out, in / 2]: own int4's values (row-major), and the reference that
    packed_int4.words_cpu_tiles (checkpoints' words) is tested against (input-major views)."""
    out_features, in_features = q.shape
    halves = q.unflatten(0, (out_features // tile_rows, 2, tile_rows // 2))
    lines = halves[:, 0] | (halves[:, 1] << 4)  # [tiles, row j of the first half, k]
    return lines.transpose(1, 2).contiguous().view(out_features, in_features // 2)


def _unpack_cpu_tiles(packed: torch.Tensor, ids: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """Rows `ids` of the CPU int4 kernel's packed matrix (tiles of `tile_rows` output channels:
    byte j of a tile's k-th line of tile_rows / 2 bytes holds row j in its low nibble, row
    j + tile_rows / 2 in its high one) -> int32 [len(ids), in_padded] in 0..15."""
    half = tile_rows // 2
    tiles = packed.view(packed.shape[0] // tile_rows, -1, half)
    row = ids % tile_rows
    lines = tiles[ids // tile_rows, :, row % half]  # [T, in]
    shift = (row // half * 4).to(torch.uint8)[:, None]
    return ((lines >> shift) & 0x0F).to(torch.int32)


class Int4Weight(Weight):
    def __init__(
        self, weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE, rows_needed: bool = False
    ) -> None:
        """`rows_needed`: an embedding, whose rows are looked up as well as multiplied by."""
        q, scale, zero = quantize_int4(weight, group_size)
        self._pack(Int4Parts(q, scale, zero, group_size, weight.shape[1]), rows_needed)

    @classmethod
    def from_parts(cls, parts: Int4Parts, rows_needed: bool = False) -> Int4Weight:
        """Values a checkpoint quantised already (layers/prequant.py), packed as they are."""
        stored = cls.__new__(cls)
        stored._pack(parts, rows_needed)
        return stored

    @classmethod
    def from_cpu_tiles(
        cls,
        packed: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group_size: int,
        in_features: int,
    ) -> Int4Weight:
        """A matrix already written in the CPU kernel's tiles (packed_int4.words_cpu_tiles),
        uint8 [out, in_padded / 2] of `cpu_int4_tile_rows()` high; scale and zero bf16
        [out, groups]. Not for an embedding (rows_needed)."""
        stored = cls.__new__(cls)
        out_features, padded_in = packed.shape[0], packed.shape[1] * 2
        stored._describe(scale, zero, group_size, in_features, (out_features, padded_in))
        stored.on_cuda, stored.packed, stored.row_copy = False, packed, None
        stored.tile_rows = stored._readable_tile_rows()
        return stored

    def _describe(
        self,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group_size: int,
        in_features: int,
        shape: tuple[int, int],
    ) -> None:
        self.in_features, self.group_size = in_features, group_size
        self.out_features, self.padded_in = shape
        # The kernels' layout, which rows() reads too: [groups, out, 2] (scale, zero) side by side.
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()

    def _pack(self, parts: Int4Parts, rows_needed: bool) -> None:
        q = parts.values
        shape = (q.shape[0], q.shape[1])
        self._describe(parts.scale, parts.zero, parts.group_size, parts.in_features, shape)
        self.on_cuda = q.device.type == "cuda"
        if self.on_cuda:  # tinygemm takes the values two per byte, high nibble first
            pairs = q.to(torch.uint8)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(
                (pairs[:, 0::2] << 4 | pairs[:, 1::2]).contiguous(), CUDA_INT4_INNER_K_TILES
            )
        else:
            self.packed = _pack_for_cpu(q)
        # rows() reads the packed tiles when their layout is one we know (`cpu_int4_tile_rows`);
        # otherwise an embedding keeps its own two-per-byte copy (CUDA, a CPU with neither
        # AVX512 nor AVX2, a vocabulary that is not a multiple of the tile's height).
        self.row_copy: torch.Tensor | None = None
        self.tile_rows = self._readable_tile_rows()
        if rows_needed and not self.tiles_readable:
            pairs = q.to(torch.uint8)
            self.row_copy = pairs[:, 0::2] | (pairs[:, 1::2] << 4)

    @property
    def tiles_readable(self) -> bool:
        return self.tile_rows is not None

    def _readable_tile_rows(self) -> int | None:
        """The height of the kernel's tiles if rows can be read from them, else None."""
        if self.on_cuda or self.packed.numel() * 2 != self.out_features * self.padded_in:
            return None
        tile_rows = cpu_int4_tile_rows()
        return None if tile_rows is None or self.out_features % tile_rows else tile_rows

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        xk = _as_kernel_input(x, torch.bfloat16, self.padded_in)
        if self.on_cuda:
            out = torch.ops.aten._weight_int4pack_mm(
                xk, self.packed, self.group_size, self.scales_and_zeros
            )
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                xk, self.packed, self.group_size, self.scales_and_zeros
            )
        return _finish(out, x.dtype, bias)

    def _values(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tile_rows is not None:
            return _unpack_cpu_tiles(self.packed, ids, self.tile_rows)
        if self.row_copy is None:
            raise RuntimeError("this int4 matrix was packed without rows_needed; rows unreadable")
        pairs = self.row_copy[ids]
        return torch.stack((pairs & 0x0F, pairs >> 4), dim=-1).flatten(-2).to(torch.int32)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.tiles_readable or self.row_copy is not None:
            return self.rows(torch.arange(self.out_features, device=self.packed.device), dtype)
        # Otherwise through the kernel itself (I @ W.T = W.T), to bf16 precision: a reference
        # for tests and tools, never a step's work.
        eye = torch.eye(self.in_features, device=self.packed.device, dtype=torch.bfloat16)
        return self.linear(eye).t().to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scale, zero = self.scales_and_zeros[:, ids].permute(2, 1, 0)  # each [T, groups]
        w = _dequantize_int4(self._values(ids), scale, zero, self.group_size)
        return w[:, : self.in_features].to(dtype)

    def num_bytes(self) -> int:
        copy = 0 if self.row_copy is None else self.row_copy.numel()
        return self.packed.numel() + self.scales_and_zeros.numel() * 2 + copy


def resolve_int8_kernel(choice: str, device: torch.device, cpu_has_int8_dot: bool) -> str:
    """The int8 level's kernel (w8a16 or w8a8) for `--int8-kernel` on this device; raises
    ValueError for w8a8 on a GPU (CUDA's `_int_mm` needs more than 16 rows, a decode has 1)."""
    if choice not in INT8_KERNEL_CHOICES:
        raise ValueError(f"int8_kernel must be one of {INT8_KERNEL_CHOICES}, got {choice!r}")
    if choice == "auto":
        return "w8a8" if device.type == "cpu" and cpu_has_int8_dot else "w8a16"
    if choice == "w8a8" and device.type != "cpu":
        raise ValueError(
            f"--int8-kernel w8a8 runs on CPU only, not {device.type}; use w8a16 or auto there"
        )
    return choice


def make_weight(
    weight: torch.Tensor,
    quantization: str,
    dtype: torch.dtype,
    rows_needed: bool = False,
    int8_kernel: str = "w8a16",
) -> Weight:
    """Store a checkpoint matrix in the format of a quantisation level; `dtype` is the compute
    dtype the model runs in; `rows_needed` for an embedding (see Int4Weight); `int8_kernel` a
    resolved one (resolve_int8_kernel)."""
    if quantization == "none":
        return DenseWeight(weight, dtype)
    if quantization == "bf16":
        return DenseWeight(weight, torch.bfloat16)
    if quantization == "int8":
        int8 = Int8Weight(weight, dtype)
        return Int8DynamicWeight(int8) if int8_kernel == "w8a8" else int8
    if quantization == "int4":
        return Int4Weight(weight, rows_needed=rows_needed)
    raise ValueError(f"quantization must be one of none, bf16, int8, int4, got {quantization!r}")
