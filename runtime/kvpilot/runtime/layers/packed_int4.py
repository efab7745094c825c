"""GPTQ and AWQ checkpoints' matrices (and compressed-tensors' int4, whose words are GPTQ's
transposed), kept as packed words until stored into the engine's int4 kernels.

Both store, per quantised linear module `m`, 4-bit values q and zero points z (0..15) packed
eight to an int32 word, and float16 `m.scales` [groups, out]; w = (q - z) * scale, where a
column's group is its input feature's. The layouts (GPTQ as AutoGPTQ / GPTQModel write it, AWQ
as AutoAWQ's GEMM version does):
- GPTQ: `m.qweight` [in / 8, out], packed along the input dimension (feature 8r + k of column j
  in nibble k of qweight[r, j]); `m.qzeros` [groups, out / 8], packed along the output dimension;
  `m.g_idx` int32 [in], each input feature's group. `checkpoint_format: gptq` (v1) stores z - 1,
  gptq_v2 stores z. Group size -1 is one group per row.
- AWQ: `m.qweight` [in, out / 8] and `m.qzeros` [groups, out / 8], both packed along the output
  dimension in AWQ's interleaved order: nibble k of a word holds output 8b + AWQ_ORDER[k].

The engine's int4 format dequantises (u - 8) * s + zero: u is q itself, s the scale and
zero = (8 - z) * s, so nothing is requantised; the scale and zero are rounded to bf16 (the
kernels' dtype), as for compressed-tensors. With GPTQ's act-order (desc_act), g_idx puts input
features into groups in the Hessian's order, not consecutively; sorting the features by group
makes each group consecutive, so the layer stores W[:, perm] and multiplies x[:, perm] by it
(x @ W.T == x[:, perm] @ W[:, perm].T), as GPTQ's exllama and Marlin kernels do.

GPTQ's words (and compressed-tensors', the same words transposed) are kept as they are until
they are stored (Int4Words): on CPU they are written into the int4 kernel's tiles straight from
the words (an input feature of a tile is one line of bytes there, so act-order's gather moves
lines), never unpacked to a byte per value; fusing q/k/v and gate/up and reordering outputs
(act-order's fold) move words. Unpacking, then packing, was most of a GPTQ checkpoint's load.
The tiles are written in one pass by torch.ops.kvpilot.int4_tiles (int4_tiles.cpp, in the
library paged_kernel.py builds) where that is built, else by tensor ops (`words_cpu_tiles`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 - the torch convention

from kvpilot.contract.checkpoint_quant import FIELD, LM_HEAD, WeightScheme
from kvpilot.contract.memory import INT4_GROUP_SIZE
from kvpilot.runtime.layers import paged_kernel
from kvpilot.runtime.layers.quant import (
    INT4_MID,
    Int4Parts,
    Int4Weight,
    Weight,
    cpu_int4_tile_rows,
)

Read = Callable[[str], torch.Tensor | None]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ packs output 8b + AWQ_ORDER[k] into nibble k
NIBBLES = 0x0F0F0F0F  # the low nibble of each byte of an int32


@dataclass(frozen=True)
class Int4Words:
    """An int4 matrix, its values as the checkpoint packs them: `words` int32 [in / 8, out]
    (input feature 8r + k of output j in nibble k of words[r, j]: GPTQ's qweight, and
    compressed-tensors' weight_packed transposed, a view), values 0..15; scale and zero bf16
    [out, groups] as in Int4Parts. `awq`: AWQ's qweight instead, [in, out / 8], packed along
    the output in AWQ's nibble order. `input_order` (act-order): stored input feature i is the
    checkpoint's input_order[i], which makes the groups consecutive; the layer multiplies
    x[:, input_order] by it (PermutedWeight), unless `input_arrives_ordered`: its input's
    producer writes the features in that order already (prequant.split_input_order).
    `column_orders`, per module of `words` (empty: none has one): the order its outputs are
    stored in, stored output i of module m being column column_orders[m][i] of words[m]
    (act-order's fold, prequant.permute_rows; never AWQ's, which is unpacked to be permuted).
    The columns are gathered a block at a time as the tiles are written: a gathered copy of
    the whole words, then read again to write the tiles, took twice as long."""

    words: tuple[torch.Tensor, ...]  # each fused module's (q/k/v, gate/up), outputs in turn
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    in_features: int
    input_order: torch.Tensor | None = None
    input_arrives_ordered: bool = False
    awq: bool = False
    column_orders: tuple[torch.Tensor | None, ...] = ()

    def outputs_of(self, words: torch.Tensor) -> int:
        return words.shape[1] * 8 if self.awq else words.shape[1]

    def orders(self) -> tuple[torch.Tensor | None, ...]:
        """Each module's column order (None: as its words stand)."""
        return self.column_orders or (None,) * len(self.words)

    def module_words(self, index: int) -> torch.Tensor:
        """Module `index`'s words with its outputs in their stored order (a copy if reordered)."""
        words, order = self.words[index], self.orders()[index]
        return words if order is None else gather_columns(words, order)

    @property
    def out_features(self) -> int:
        return sum(self.outputs_of(words) for words in self.words)

    def all_words(self) -> torch.Tensor:
        """The modules' words side by side: one matrix (a copy where several are fused)."""
        modules = [self.module_words(index) for index in range(len(self.words))]
        return modules[0] if len(modules) == 1 else torch.cat(modules, dim=1)

    @property
    def padded_in(self) -> int:
        return self.scale.shape[1] * self.group_size


def gather_columns(words: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """words[:, columns], contiguous: gather, not index_select (~6x faster along dim 1 on CPU)."""
    return torch.gather(words, 1, columns.expand(words.shape[0], -1))


def unpack_int32(packed: torch.Tensor, num_bits: int, num_values: int) -> torch.Tensor:
    """[rows, words] int32, value i of a row at bits num_bits * i (4 or 8 bits, so never across
    a word) -> its unsigned values uint8 [rows, num_values], zero where the row ran out. Bytes,
    not int32: every later copy (padding, fusing q/k/v, packing) moves a quarter as much."""
    if sys.byteorder == "little":  # value i sits in byte i * num_bits // 8 of the row
        values = packed.contiguous().view(torch.uint8)  # [rows, words * 4]
        if num_bits == 4:  # byte j: value 2j in its low nibble, 2j + 1 in its high one
            values = torch.stack((values & 0x0F, values >> 4), dim=-1).flatten(1)
    else:
        per_word = 32 // num_bits
        shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * num_bits
        values = ((packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)).flatten(1)
        values = values.to(torch.uint8)
    if values.shape[1] < num_values:
        values = F.pad(values, (0, num_values - values.shape[1]))
    return values[:, :num_values].contiguous()


def _need(read: Read, name: str) -> torch.Tensor:
    tensor = read(name)
    if tensor is None:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    return tensor


def read_packed_int4(
    read: Read, module: str, scheme: WeightScheme
) -> torch.Tensor | Int4Parts | Int4Words:
    """Module `module` of a GPTQ or AWQ checkpoint; a dense matrix where the quantiser left a
    decoder module out (it wrote `weight`, not `qweight`). The lm_head is quantised only where
    the config says so (`lm_head: true`), and then must be."""
    qweight = read(f"{module}.qweight")
    if qweight is None and module == LM_HEAD:
        raise ValueError(
            f"checkpoint is missing tensor '{LM_HEAD}.qweight' (its {FIELD}.lm_head is true)"
        )
    if qweight is None:
        return _need(read, f"{module}.weight")
    scale = _need(read, f"{module}.scales").float().t()  # [out, groups]
    qzeros = _need(read, f"{module}.qzeros")
    if scheme.format == "awq-gemm":
        zeros = unpack_awq(qzeros).t()  # [out, groups]
        in_features = qweight.shape[0]
        return int4_words(module, qweight, scale, zeros, scheme.group_size, in_features, awq=True)
    g_idx = read(f"{module}.g_idx")
    in_features = qweight.shape[0] * 8 if g_idx is None else g_idx.numel()
    zeros = unpack_int32(qzeros, 4, qweight.shape[1]).t()  # [out, groups]
    zeros = zeros + 1 if scheme.format == "gptq" else zeros  # v1 stored z - 1
    order = None  # group -1: one scale for the whole row, whatever g_idx's order
    if scheme.group_size is not None:
        args = (module, g_idx, scheme.group_size, in_features, scheme.desc_act)
        order = act_order_permutation(*args)
    return int4_words(module, qweight, scale, zeros, scheme.group_size, in_features, order)


def int4_words(
    module: str,
    words: torch.Tensor,
    scale: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int | None,
    in_features: int,
    input_order: torch.Tensor | None = None,
    awq: bool = False,
) -> Int4Words:
    """A checkpoint's int4 matrix (GPTQ, AWQ, compressed-tensors): its words as stored, scale
    [out, groups] float and zero points [out, groups] 0..16 (w = (q - z) * scale). Group size
    None: one group per row, its scale and zero repeated for each of the kernels' groups."""
    size = group_size or INT4_GROUP_SIZE
    if group_size is None:
        groups = -(-in_features // size)
        scale, zeros = scale.expand(-1, groups), zeros.expand(-1, groups)
    if scale.shape[1] * size < in_features:
        raise ValueError(f"{module}: {scale.shape[1]} groups of {size} cannot hold {in_features}")
    zero = (INT4_MID - zeros.float()) * scale  # the engine's: (q - 8) * scale + zero
    bf16 = torch.bfloat16
    return Int4Words(
        (words,), scale.to(bf16), zero.to(bf16), size, in_features, input_order, awq=awq
    )


def unpack_input_major(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """GPTQ's qweight int32 [in / 8, out] (feature 8r + k of column j in nibble k of [r, j]) ->
    uint8 [in, out], the input features as rows."""
    nibbles = [((qweight >> (4 * k)) & 0x0F).to(torch.uint8) for k in range(8)]
    return torch.stack(nibbles, dim=1).view(-1, qweight.shape[1])[:in_features]


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 8] int32 in AWQ's nibble order -> uint8 [rows, cols] in column order.
    AWQ's order puts columns 0, 2, 4, 6 of a word in its low 16 bits and 1, 3, 5, 7 in its
    high ones, so spreading each half's nibbles into bytes and joining them orders the word
    (word arithmetic; gathering the unpacked nibbles was most of an AWQ checkpoint's load)."""
    even, odd = _spread_nibbles(packed & 0xFFFF), _spread_nibbles((packed >> 16) & 0xFFFF)
    return unpack_int32(even | (odd << 4), 4, packed.shape[1] * 8)


def _spread_nibbles(half_words: torch.Tensor) -> torch.Tensor:
    """int32 holding 4 nibbles in its low 16 bits -> nibble m in the low half of byte m."""
    spread = (half_words | (half_words << 8)) & 0x00FF00FF
    return (spread | (spread << 4)) & NIBBLES


def act_order_permutation(
    module: str, g_idx: torch.Tensor | None, group_size: int, in_features: int, desc_act: bool
) -> torch.Tensor | None:
    """The input permutation that makes g_idx's groups consecutive runs of `group_size`
    features; None when they are already (no act-order, or GPTQ's static groups)."""
    consecutive = torch.arange(in_features) // group_size
    if g_idx is None:
        if desc_act:
            raise ValueError(f"checkpoint is missing tensor '{module}.g_idx' (desc_act is true)")
        return None
    g_idx = g_idx.long()
    if torch.equal(g_idx, consecutive):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], consecutive):
        raise ValueError(
            f"{module}.g_idx puts a number of input features other than group_size "
            f"({group_size}) into a group; such a GPTQ checkpoint is not supported"
        )
    return perm


def _int4_parts(
    values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> Int4Parts:
    """values [out, in] 0..15 -> the engine's int4 parts, the input padded to whole groups
    (zero activations meet it). values may stay a transposed view of input-major bytes: the
    packing reads either layout."""
    in_features, padded = values.shape[1], scale.shape[1] * group_size
    if padded > in_features:
        values = F.pad(values, (0, padded - in_features), value=INT4_MID)
    return Int4Parts(values, scale, zero, group_size, in_features)


def unpack_words(parts: Int4Words) -> Int4Parts:
    """The words unpacked to a byte per value, input features in `input_order`: for CUDA's
    kernel, a CPU tile layout we do not know, and the reference dequantisation."""
    if parts.awq:  # [in, out]
        values = unpack_awq(parts.all_words()).t()
        return _int4_parts(values, parts.scale, parts.zero, parts.group_size)
    by_input = unpack_input_major(parts.all_words(), parts.in_features)
    if parts.input_order is not None:
        by_input = by_input.index_select(0, parts.input_order)
    return _int4_parts(by_input.t(), parts.scale, parts.zero, parts.group_size)


PADDING_BYTE = INT4_MID * 0x11  # two values of 8: a zero weight in both nibbles
TILES_BLOCK_BYTES = 512 * 1024  # words written into tiles at a time: kept in the cache


def words_cpu_tiles(parts: Int4Words, tile_rows: int, compiled: bool | None = None) -> torch.Tensor:
    """The CPU int4 kernel's packed matrix [out, padded_in / 2] (its layout:
    quant._unpack_cpu_tiles) written from the words, fused modules each into their own tiles
    (their words are never concatenated); every module's outputs a whole number of tiles.
    Little-endian words (bytes read in memory order). `compiled`: by torch.ops.kvpilot.int4_tiles
    (int4_tiles.cpp: one pass, no temporaries), else by tensor ops; None: compiled where the
    kernel library is built (paged_kernel.loaded_without_building).

    The tensor ops: line k of a tile holds input feature k of the tile's row j in byte j's low
    nibble and of row j + tile_rows / 2 in its high one; a word's byte b holds features 2b and
    2b + 1 of one output, so word arithmetic on the two halves of a tile makes the line bytes of
    the even features and of the odd ones at once, a block of tiles at a time, so that each pass
    reads what the last wrote from the cache."""
    if compiled is None:
        compiled = paged_kernel.loaded_without_building()
    num_tiles = parts.out_features // tile_rows
    tiles = torch.empty(num_tiles, parts.padded_in, tile_rows // 2, dtype=torch.uint8)
    if not compiled:
        tiles[:, parts.in_features :] = PADDING_BYTE
    first = 0
    for words, order in zip(parts.words, parts.orders(), strict=True):
        module_tiles = tiles[first : first + parts.outputs_of(words) // tile_rows]
        if compiled:
            torch.ops.kvpilot.int4_tiles(
                words, order, parts.input_order, parts.in_features, parts.awq, module_tiles
            )
        elif parts.awq:
            _write_awq_tiles(words, module_tiles)
        else:
            _write_tiles(words, order, module_tiles, parts)
        first += module_tiles.shape[0]
    return tiles.view(parts.out_features, parts.padded_in // 2)


def _write_tiles(
    words: torch.Tensor, order: torch.Tensor | None, tiles: torch.Tensor, parts: Int4Words
) -> None:
    """One module's input-packed words [in / 8, out] into its tiles [tiles, padded_in, half],
    its outputs in `order` (None: as they stand)."""
    word_rows, num_tiles, half = words.shape[0], tiles.shape[0], tiles.shape[2]
    halves = words.unflatten(1, (num_tiles, 2, half))  # a view, either memory order
    per_block = max(1, TILES_BLOCK_BYTES // (word_rows * half * 8))
    whole = parts.padded_in == parts.in_features == word_rows * 8  # lines written in place
    for first in range(0, num_tiles, per_block):
        block = slice(first, min(first + per_block, num_tiles))
        if order is None:
            block_halves = halves[:, block]
        else:  # the block's outputs gathered: read once, and kept in the cache for the lines
            columns = order[block.start * 2 * half : block.stop * 2 * half]
            block_halves = gather_columns(words, columns).view(word_rows, -1, 2, half)
        if whole and parts.input_order is None:
            _tile_lines(block_halves, out=tiles[block])
            continue
        lines = _tile_lines(block_halves)[:, : parts.in_features]
        if parts.input_order is None:
            tiles[block, : parts.in_features] = lines
        elif whole:  # act-order: a line per feature, gathered as lines
            torch.index_select(lines, 1, parts.input_order, out=tiles[block])
        else:
            tiles[block, : parts.in_features] = lines.index_select(1, parts.input_order)


def _write_awq_tiles(words: torch.Tensor, tiles: torch.Tensor) -> None:
    """AWQ's words [in, out / 8] into `tiles` [tiles, padded_in, half]. Words pack outputs, so
    input feature k's line of a tile is made from row k's words alone: word w of its first half
    (outputs 8w..8w+7, low nibbles of the line's bytes 8w..8w+7) with word w of its second half
    (their high nibbles). A block of input rows at a time (cache)."""
    num_tiles, _, half = tiles.shape
    rows, words_per_half = words.shape[0], half // 8
    per_block = max(1, TILES_BLOCK_BYTES // (words.shape[1] * 4))
    for first in range(0, rows, per_block):
        block = slice(first, min(first + per_block, rows))
        halves = words[block].view(-1, num_tiles, 2, words_per_half)
        line_words = _awq_line_words(halves[:, :, 0], halves[:, :, 1])  # [rows, tiles, words]
        tiles[:, block].view(torch.int64).copy_(line_words.transpose(0, 1))


def _awq_line_words(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Two AWQ words (int32, same shape) -> int64: byte i holds output i of `low` in its low
    nibble and of `high` in its high one. AWQ puts output AWQ_ORDER[k] in nibble k, so pairing
    the words' nibbles byte by byte (even nibbles, then odd ones) gives the bytes of nibbles
    [0, 2, 4, 6 | 1, 3, 5, 7], which are outputs [0, 4, 1, 5 | 2, 6, 3, 7]; two byte swaps
    inside the int64 put them in output order: byte index (p, b1, b0) goes to (b0, p, b1)."""
    pair = torch.empty(*low.shape, 2, dtype=torch.int32)  # as int64: even | odd << 32
    even, odd = pair[..., 0], pair[..., 1]
    torch.bitwise_and(high, NIBBLES, out=even)
    even <<= 4
    even |= low & NIBBLES
    torch.bitwise_and(high, ~NIBBLES, out=odd)
    odd |= (low >> 4) & NIBBLES
    line_words = pair.view(torch.int64).squeeze(-1)
    scratch = torch.empty_like(line_words)
    _swap_bits(line_words, 8, 0x0000FF000000FF00, scratch)  # bytes (p, b1, b0) -> (p, b0, b1)
    _swap_bits(line_words, 16, 0x00000000FFFF0000, scratch)  # -> (b0, p, b1)
    return line_words


def _swap_bits(x: torch.Tensor, distance: int, mask: int, scratch: torch.Tensor) -> None:
    """In place: the bits of x under `mask` trade places with those `distance` bits above."""
    torch.bitwise_right_shift(x, distance, out=scratch)
    scratch ^= x
    scratch &= mask
    x ^= scratch
    scratch <<= distance
    x ^= scratch


def _tile_lines(halves: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [in / 8, tiles, 2, half] (each tile's two halves of words) -> its lines, uint8
    [tiles, in, half], feature by feature in the words' order; written into `out` if given."""
    word_rows, num_tiles, _, half = halves.shape
    low, high = halves[:, :, 0], halves[:, :, 1]
    even = (low & NIBBLES) | ((high & NIBBLES) << 4)
    odd = ((low >> 4) & NIBBLES) | (high & ~NIBBLES)
    shape = (num_tiles, word_rows, 4, 2, half)
    lines = torch.empty(shape, dtype=torch.uint8) if out is None else out.view(shape)
    for parity, made in enumerate((even, odd)):
        if made.is_contiguous():  # input-major (GPTQ): byte b of a tile line's words is a line
            made_bytes = made.view(torch.uint8).view(word_rows, num_tiles, half, 4)
            for byte in range(4):
                lines[:, :, byte, parity] = made_bytes[..., byte].transpose(0, 1)
        else:  # output-major (compressed-tensors: the elementwise ops keep that order)
            lines[:, :, :, parity] = _output_major_bytes(made)
    return lines.view(num_tiles, word_rows * 8, half)


def _output_major_bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 [in / 8, tiles, half], its memory output-major -> each word's 4 bytes, uint8
    [tiles, in / 8, 4, half], a view of that memory (no transposed copy of the words)."""
    word_rows, num_tiles, half = words.shape
    by_output = words.permute(1, 2, 0).contiguous()  # a view: the memory is in this order
    return by_output.view(torch.uint8).view(num_tiles, half, word_rows, 4).permute(0, 2, 3, 1)


def store_words(parts: Int4Words, device: torch.device) -> Weight:
    """The stored matrix: written into the CPU kernel's tiles from the words where their
    layout is known, else unpacked and packed by the kernel's own op (Int4Weight.from_parts)."""
    on_cpu = device.type == "cpu" and sys.byteorder == "little"
    tile_rows = cpu_int4_tile_rows() if on_cpu else None
    whole_tiles = tile_rows is not None and all(
        parts.outputs_of(words) % tile_rows == 0 for words in parts.words
    )
    if tile_rows is not None and whole_tiles:
        tiles = words_cpu_tiles(parts, tile_rows)
        weight = Int4Weight.from_cpu_tiles(
            tiles, parts.scale, parts.zero, parts.group_size, parts.in_features
        )
    else:
        weight = Int4Weight.from_parts(unpack_words(parts).to(device))
    if parts.input_order is None or parts.input_arrives_ordered:
        return weight
    return PermutedWeight(weight, parts.input_order.to(device))


class PermutedWeight(Weight):
    """A desc_act matrix: its input features stored in group order, the activation's permuted
    to meet them (one gather of [T, in] per step, against the matmul's [in, out] read)."""

    def __init__(self, weight: Weight, perm: torch.Tensor) -> None:
        self.weight, self.perm = weight, perm

    @functools.cached_property
    def inverse(self) -> torch.Tensor:
        """Where each checkpoint feature is stored: for dequantize and rows only (not a step's
        matmul), so computed when first asked, not for every act-order matrix at load."""
        return torch.argsort(self.perm)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.weight.linear(x.index_select(-1, self.perm), bias)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.dequantize(dtype)[:, self.inverse]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.rows(ids, dtype)[:, self.inverse]

    def num_bytes(self) -> int:
        return self.weight.num_bytes() + self.perm.numel() * self.perm.element_size()


class OutputPermutedWeight(Weight):
    """A matrix whose output features are stored in another order (prequant.split_input_order):
    output i is stored row `order[i]`; gathered back to the checkpoint's order at each step."""

    def __init__(self, weight: Weight, order: torch.Tensor) -> None:
        self.weight, self.order = weight, order

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self.weight.linear(x).index_select(-1, self.order)
        return out if bias is None else out + bias

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.dequantize(dtype)[self.order]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.rows(self.order[ids], dtype)

    def num_bytes(self) -> int:
        return self.weight.num_bytes() + self.order.numel() * self.order.element_size()
