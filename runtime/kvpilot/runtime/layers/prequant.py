"""A pre-quantised checkpoint's matrices, read once at load into the engine's own formats.

compressed-tensors stores, per quantised linear module `m` (contract/checkpoint_quant.py says
which are):
- fp8: `m.weight` float8_e4m3fn [out, in], `m.weight_scale` [out, 1] or [1]: w = q * scale.
  Dequantised here ONCE to float32 and stored in the compute dtype like any 16-bit matrix: the
  CPU has no fp8 matmul, and re-quantising e4m3 to the int8 grid would add a second rounding
  (values near zero are finer in e4m3 than an int8 step). So an fp8 checkpoint costs the
  compute dtype's bytes in memory; what it saves is download and disk. A CUDA path would keep
  the e4m3 bytes and run `torch._scaled_mm` (Hopper/Ada) or a Marlin-class fp8 weight-only kernel.
- int4 (`pack-quantized`): `m.weight_packed` int32 [out, in / 8], value i of a row at bits
  4i..4i+3 (little-endian words), stored as q + 8 for q in -8..7; `m.weight_scale` [out, groups];
  asymmetric adds `m.weight_zero_point` int32 [out / 8, groups], packed the same way along the
  output dimension; w = (q - z) * scale. The engine's int4 format dequantises (u - 8) * s + zero
  with u in 0..15: u is the stored nibble itself, s the scale and zero = -z * s, so the values are
  repacked into the kernels' tiles without requantising (the scale and zero rounded to bf16, the
  kernels' dtype). One scale per channel becomes one per group of 128, repeated.
- int8: `m.weight_packed` (four values per int32, stored as q + 128) or `m.weight` int8 (naive),
  `m.weight_scale` [out, 1]: exactly the engine's int8 format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvpilot.contract.checkpoint_quant import CheckpointQuant, WeightScheme
from kvpilot.runtime.layers.packed_int4 import (
    Int4Words,
    gather_columns,
    int4_words,
    read_packed_int4,
    store_words,
    unpack_int32,
    unpack_words,
)
from kvpilot.runtime.layers.quant import (
    INT4_MID,
    Int4Parts,
    Int4Weight,
    Int8DynamicWeight,
    Int8Weight,
    Weight,
    make_weight,
)

INT8_OFFSET = 128  # pack-quantized stores an int8 value q as the byte q + 128
Read = Callable[[str], torch.Tensor | None]


@dataclass(frozen=True)
class Int8Parts:
    values: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # [out]


# A dense matrix, or one the checkpoint quantised (GPTQ/AWQ: layers/packed_int4.py).
Matrix = torch.Tensor | Int4Parts | Int8Parts | Int4Words
__all__ = [
    "Matrix",
    "concat",
    "dequantize",
    "read_matrix",
    "split_input_order",
    "store",
    "unpack_int32",
]


def read_matrix(
    read: Read, module: str, quant: CheckpointQuant | None, rows: torch.Tensor | None = None
) -> Matrix:
    """Module `module`'s weight matrix as the checkpoint stores it, in the engine's terms.
    `rows`: output feature i is the checkpoint's rows[i] (split_input_order says why)."""
    scheme = quant.scheme_for(module) if quant is not None else None
    if scheme is None:
        matrix: Matrix = _need(read, f"{module}.weight")
    elif quant is not None and quant.method in ("gptq", "awq"):
        matrix = read_packed_int4(read, module, scheme)
    elif scheme.type == "float":
        matrix = _fp8(read, module)
    elif scheme.num_bits == 8:
        matrix = _int8(read, module, scheme)
    else:
        matrix = _int4(read, module, scheme)
    if rows is None:
        return matrix
    if rows.numel() != _num_outputs(matrix):
        raise ValueError(
            f"{module} has {_num_outputs(matrix)} outputs; cannot feed {rows.numel()} inputs"
        )
    return permute_rows(matrix, rows)


def _num_outputs(matrix: Matrix) -> int:
    if isinstance(matrix, torch.Tensor):
        return matrix.shape[0]
    return matrix.out_features if isinstance(matrix, Int4Words) else matrix.values.shape[0]


def _need(read: Read, name: str) -> torch.Tensor:
    tensor = read(name)
    if tensor is None:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    return tensor


def _fp8(read: Read, module: str) -> torch.Tensor:
    weight = _need(read, f"{module}.weight")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{module}.weight is {weight.dtype}, its scheme says float8_e4m3fn")
    scale = _need(read, f"{module}.weight_scale").float()
    return weight.float() * scale.reshape(-1, 1) if scale.numel() > 1 else weight.float() * scale


def _int8(read: Read, module: str, scheme: WeightScheme) -> Int8Parts:
    if scheme.format == "pack-quantized":
        packed = _need(read, f"{module}.weight_packed")
        shape = _need(read, f"{module}.weight_shape").tolist()
        values = (unpack_int32(packed, 8, shape[1]).to(torch.int16) - INT8_OFFSET).to(torch.int8)
    else:
        values = _need(read, f"{module}.weight")
    if values.dtype != torch.int8:
        raise ValueError(f"{module}.weight is {values.dtype}, its scheme says int8")
    return Int8Parts(values, _need(read, f"{module}.weight_scale").reshape(-1))


def _int4(read: Read, module: str, scheme: WeightScheme) -> Int4Words:
    packed = _need(read, f"{module}.weight_packed")  # [out, in / 8]: Int4Words' words, transposed
    out_features, in_features = _need(read, f"{module}.weight_shape").tolist()
    scale = _need(read, f"{module}.weight_scale").float()  # [out, groups]
    zeros = torch.full_like(scale, INT4_MID)  # symmetric: q + 8 is stored, z = 8
    if not scheme.symmetric:
        packed_zeros = _need(read, f"{module}.weight_zero_point")  # [out / 8, groups]
        zeros = unpack_int32(packed_zeros.t().contiguous(), 4, out_features).t()
    return int4_words(module, packed.t(), scale, zeros, scheme.group_size, in_features)


def concat(matrices: list[Matrix]) -> Matrix:
    """Matrices stacked along the output dimension (q/k/v and gate/up are fused), kept in their
    format when they share one; otherwise (one of them ignored by the checkpoint) all dense."""
    if all(isinstance(m, torch.Tensor) for m in matrices):
        return torch.cat(matrices)  # type: ignore[arg-type]
    if all(isinstance(m, Int8Parts) for m in matrices):
        parts8 = [m for m in matrices if isinstance(m, Int8Parts)]
        return Int8Parts(
            torch.cat([m.values for m in parts8]), torch.cat([m.scale for m in parts8])
        )
    if all(isinstance(m, Int4Words) for m in matrices):
        return _concat_words([m for m in matrices if isinstance(m, Int4Words)])
    parts4 = [m for m in matrices if isinstance(m, Int4Parts)]
    same_groups = all(m.group_size == parts4[0].group_size for m in parts4)
    if parts4 and len(parts4) == len(matrices) and same_groups:
        return Int4Parts(
            torch.cat([m.values for m in parts4]),
            torch.cat([m.scale for m in parts4]),
            torch.cat([m.zero for m in parts4]),
            parts4[0].group_size,
            parts4[0].in_features,
        )
    return torch.cat([dequantize(m) for m in matrices])


def _concat_words(matrices: list[Int4Words]) -> Matrix:
    """The modules' words in turn (each is written into its own tiles at store). With GPTQ's
    act-order, q/k/v (or gate/up) share one input, so GPTQ orders their features alike (one
    Hessian); fused they share one order. Otherwise they are stored dense."""
    first = matrices[0]
    same = [(m.group_size, m.in_features, m.scale.shape[1], m.awq) for m in matrices]
    if len(set(same)) > 1 or not all(_same_order(m, first) for m in matrices):
        return torch.cat([dequantize(m) for m in matrices])
    orders = tuple(order for m in matrices for order in m.orders())
    return Int4Words(
        tuple(words for m in matrices for words in m.words),  # not copied: tiles per module
        torch.cat([m.scale for m in matrices]),
        torch.cat([m.zero for m in matrices]),
        first.group_size,
        first.in_features,
        first.input_order,
        first.input_arrives_ordered,
        first.awq,
        orders if any(order is not None for order in orders) else (),
    )


def _same_order(a: Int4Words, b: Int4Words) -> bool:
    if a.input_arrives_ordered != b.input_arrives_ordered:
        return False
    if a.input_order is None or b.input_order is None:
        return a.input_order is b.input_order
    return torch.equal(a.input_order, b.input_order)


def split_input_order(consumer: Matrix) -> tuple[Matrix, torch.Tensor | None]:
    """GPTQ act-order stores `consumer` (down_proj) with its input features in group order,
    which costs a gather of its input at every step (PermutedWeight). When that input is made
    feature by feature from other matrices' outputs (gate's and up's: silu(gate) * up is
    elementwise), those are read with their output rows in that order instead
    (read_matrix's `rows`) and the step gathers nothing. Returns the consumer taking its input
    in that order and the order of the features between them (feature i is the checkpoint's
    order[i]), or the consumer as it is and None when it gathers nothing."""
    if not isinstance(consumer, Int4Words) or consumer.input_order is None:
        return consumer, None
    if consumer.input_arrives_ordered:  # split already: its producer writes that order
        return consumer, None
    return replace(consumer, input_arrives_ordered=True), consumer.input_order


def permute_rows(matrix: Matrix, rows: torch.Tensor) -> Matrix:
    """The matrix with output feature i taken from the checkpoint's output rows[i]."""
    if isinstance(matrix, torch.Tensor):
        return matrix[rows]
    if isinstance(matrix, Int8Parts):
        return Int8Parts(matrix.values[rows], matrix.scale[rows])
    if isinstance(matrix, Int4Words) and matrix.awq:  # eight outputs a word: unpacked first
        return permute_rows(unpack_words(matrix), rows)
    if isinstance(matrix, Int4Words):  # outputs are the words' columns; the input order stays
        scale, zero = matrix.scale[rows], matrix.zero[rows]
        if len(matrix.words) > 1:  # fused already: one module's words, reordered now
            return replace(
                matrix, words=(gather_columns(matrix.all_words(), rows),), column_orders=(),
                scale=scale, zero=zero,
            )  # fmt: skip
        current = matrix.orders()[0]  # reordered as the words are written (Int4Words)
        order = rows if current is None else current[rows]
        return replace(matrix, column_orders=(order,), scale=scale, zero=zero)
    return Int4Parts(
        matrix.values.contiguous()[rows],  # values may be a transposed view (AWQ unpacked)
        matrix.scale[rows],
        matrix.zero[rows],
        matrix.group_size,
        matrix.in_features,
    )


def dequantize(matrix: Matrix) -> torch.Tensor:
    """float32 [out, in]: the reference the tests compare with, and the fallback of concat."""
    if isinstance(matrix, torch.Tensor):
        return matrix.float()
    if isinstance(matrix, Int8Parts):
        return matrix.values.float() * matrix.scale.float()[:, None]
    if isinstance(matrix, Int4Words):
        unpacked = dequantize(unpack_words(matrix))  # its input features in input_order
        order = matrix.input_order
        if order is None or matrix.input_arrives_ordered:
            return unpacked
        return unpacked[:, torch.argsort(order)]
    groups = (matrix.values.float() - INT4_MID).unflatten(-1, (-1, matrix.group_size))
    w = groups * matrix.scale.float()[..., None] + matrix.zero.float()[..., None]
    return w.flatten(-2)[:, : matrix.in_features]


def store(
    matrix: Matrix,
    quantization: str,
    dtype: torch.dtype,
    device: torch.device,
    rows_needed: bool = False,
    int8_kernel: str = "w8a16",
) -> Weight:
    """The stored weight: a dense matrix in the level `quantization`; a quantised one as the
    checkpoint quantised it, packed once for the engine's kernels."""
    if isinstance(matrix, torch.Tensor):
        return make_weight(matrix.to(device), quantization, dtype, rows_needed, int8_kernel)
    if isinstance(matrix, Int8Parts):
        int8 = Int8Weight.from_parts(matrix.values.to(device), matrix.scale.to(device), dtype)
        return Int8DynamicWeight(int8) if int8_kernel == "w8a8" else int8
    if isinstance(matrix, Int4Words):
        return store_words(matrix, device)
    return Int4Weight.from_parts(matrix.to(device), rows_needed)
