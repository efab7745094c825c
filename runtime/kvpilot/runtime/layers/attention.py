"""Paged attention (CPU and CUDA).

The KV cache of a layer is [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim] for keys and for
values, stored in the `--kv-cache-dtype` and read back in the query's dtype (kv_cache.py). New
keys/values are written at `slot_mapping` (block_id * BLOCK_SIZE + offset). Attention runs on one
of three backends (`--attention-backend`):
- `paged` (CPU): one call of our kernel (paged_kernel.py) for all decode rows, which walks each
  block table and reads the blocks where they lie, with an online softmax;
- `flashinfer` (CUDA): FlashInfer's paged decode and prefill kernels for every row, reading the
  blocks in place (flashinfer_attention.py);
- `sdpa`: decodes batched into gathers of similar context length (a copy of their blocks), then
  torch's SDPA over the copy.
Except on `flashinfer`, prefill chunks run one sequence at a time through SDPA, so no query
padding is wasted.

Everything that is the same in every layer (which rows a group owns, the block tables, the
masks) is built once per step by the model runner, so a layer only reads the cache and attends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the torch convention

from kvpilot.runtime.layers import paged_kernel
from kvpilot.runtime.layers.flashinfer_attention import FlashInferStep
from kvpilot.runtime.layers.kv_cache import PagedCache

# SDPA shares K/V heads itself from torch 2.5 on (twice as fast as copying them on CPU).
HAS_SDPA_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)
GQA_KWARGS: dict[str, Any] = {"enable_gqa": True} if HAS_SDPA_GQA else {}


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the flat token batch
    num_tokens: int  # query length
    num_computed: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks_of_seq] long
    # [G * T, num_computed + T] additive (0 / -inf), query rows grouped as `grouped` lays them
    # out; only a chunk over cached KV needs one (see `chunk_mask`).
    mask: torch.Tensor | None = None


@dataclass
class DecodeGroup:
    """Decodes of similar context length, batched into one gather (less padding to copy). Their
    rows are consecutive in the flat batch, so a layer slices them instead of indexing."""

    start: int  # first row of these decode tokens in the flat batch
    block_ids: torch.Tensor  # [B * max_blocks] long: the block tables, padded with block 0
    mask: torch.Tensor  # [B, 1, 1, max_blocks * BS] additive: 0 inside the context, -inf past it

    @property
    def num_seqs(self) -> int:
        return self.mask.shape[0]


@dataclass
class PagedDecodes:
    """All decode rows for the paged kernel: rows 0..B-1 of the flat batch."""

    block_tables: torch.Tensor  # [B, W] int32, padded with block 0 past a sequence's blocks
    context_lens: torch.Tensor  # [B] int32, the row's own token included

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long
    decodes: list[DecodeGroup] = field(default_factory=list)  # sdpa backend
    prefills: list[PrefillSpan] = field(default_factory=list)
    paged_decodes: PagedDecodes | None = None  # paged backend
    flashinfer: FlashInferStep | None = None  # flashinfer backend: every row, planned


def resolve_attention_backend(
    choice: str,
    device: torch.device,
    kv_in_model_dtype: bool,
    kernel_error: Callable[[], str | None],
    flashinfer_error: Callable[[], str | None],
) -> tuple[str, str]:
    """`--attention-backend` -> (paged, flashinfer or sdpa; why). `kernel_error` builds or loads
    the CPU kernel, `flashinfer_error` imports FlashInfer (and judges the KV dtype: it reads fp8
    itself); each says why it cannot (None: it can) and is called only where it could run."""
    if choice == "sdpa":
        return "sdpa", "--attention-backend sdpa"
    if device.type != "cpu":
        if choice == "paged":
            raise ValueError(
                f"--attention-backend paged is a CPU kernel; on {device} use auto or sdpa"
            )
        return _in_place_or_sdpa(choice, "flashinfer", "FlashInfer", flashinfer_error)
    if choice == "flashinfer":
        raise ValueError(
            "--attention-backend flashinfer runs FlashInfer's CUDA kernels; on cpu use auto, "
            "paged or sdpa"
        )

    def paged_error() -> str | None:
        if not kv_in_model_dtype:
            return (
                "the paged kernel reads the KV cache in the model dtype; with --kv-cache-dtype "
                "fp8 (or another dtype than the model's) use --attention-backend auto or sdpa"
            )
        return kernel_error()

    return _in_place_or_sdpa(choice, "paged", "the CPU kernel", paged_error)


def _in_place_or_sdpa(
    choice: str, backend: str, what: str, error_of: Callable[[], str | None]
) -> tuple[str, str]:
    """`backend` (which reads the cache in place) where it can run, else sdpa under `auto`; a
    ValueError saying why when it was asked for by name."""
    error = error_of()
    if error is None:
        return backend, f"{choice}: {what} is ready"
    if choice == backend:
        raise ValueError(error)
    return "sdpa", f"auto: {error}"


def additive_mask(is_visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool visibility -> 0 / -inf in the query's dtype. SDPA adds a float mask as it is, where a
    bool one is converted again in every layer."""
    mask = torch.zeros(is_visible.shape, dtype=dtype, device=is_visible.device)
    return mask.masked_fill_(~is_visible, float("-inf"))


def decode_mask(context_lens: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """context_lens: [B] -> [B, 1, 1, num_slots]: each query sees its first context_len keys."""
    positions = torch.arange(num_slots, device=context_lens.device)
    return additive_mask(positions[None, :] < context_lens[:, None], dtype)[:, None, None, :]


def chunk_mask(
    num_tokens: int, num_computed: int, num_groups: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[G * T, num_computed + T]: query i of the chunk sees keys <= num_computed + i."""
    is_visible = torch.ones(num_tokens, num_computed + num_tokens, dtype=torch.bool, device=device)
    return additive_mask(is_visible.tril(diagonal=num_computed), dtype).repeat(num_groups, 1)


def repeat_kv(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[B, H_kv, L, D] -> [B, H_kv * num_groups, L, D] for grouped-query attention."""
    return x if num_groups == 1 else x.repeat_interleave(num_groups, dim=1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: PagedCache,
    v_cache: PagedCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, H_kv, D] -> [T, H, D]."""
    k_cache.write(k, meta.slot_mapping)
    v_cache.write(v, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.flashinfer is not None:
        return meta.flashinfer.attend(q, k_cache, v_cache, out)
    if meta.paged_decodes is not None:
        paged = meta.paged_decodes
        rows = slice(0, paged.num_seqs)
        out[rows] = paged_kernel.paged_decode_attention(
            q[rows], k_cache.data, v_cache.data, paged.block_tables, paged.context_lens, scale
        )
    for group in meta.decodes:
        rows = slice(group.start, group.start + group.num_seqs)
        out[rows] = _decode(q[rows], k_cache, v_cache, group, scale)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, span, scale)
    return out


def grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[T, H, D] -> [H_kv, G * T, D]: the G query heads sharing a KV head become extra query
    rows, so grouped-query attention needs no copy of K/V per query head."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    q = q.view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [H_kv, G, T, D]
    return q.reshape(num_kv_heads, group * num_tokens, head_dim)


def ungrouped(out: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[H_kv, G * T, D] -> [T, H, D], inverting `grouped`."""
    num_kv_heads, _, head_dim = out.shape
    out = out.view(num_kv_heads, -1, num_tokens, head_dim).permute(2, 0, 1, 3)  # [T, H_kv, G, D]
    return out.reshape(num_tokens, -1, head_dim)


def _decode(
    q: torch.Tensor, k_cache: PagedCache, v_cache: PagedCache, group: DecodeGroup, scale: float
) -> torch.Tensor:
    """q: [B, H, D], one query per sequence -> [B, H, D]."""
    num_seqs, num_heads, head_dim = q.shape
    keys = k_cache.gather(group.block_ids, num_seqs, q.dtype)  # [B, H_kv, L, D]
    values = v_cache.gather(group.block_ids, num_seqs, q.dtype)
    q_grouped = q.view(num_seqs, keys.shape[1], -1, head_dim)  # [B, H_kv, G, D]
    out = F.scaled_dot_product_attention(
        q_grouped, keys, values, attn_mask=group.mask, scale=scale
    )  # [B, H_kv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: PagedCache,
    v_cache: PagedCache,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:
    """One sequence's chunk. q: [T, H, D], k/v: [T, H_kv, D] -> [T, H, D]."""
    num_kv_heads = k.shape[1]
    # The whole context is this chunk: plain causal attention on the fresh keys and values, so
    # a first chunk never reads its own context back through a lossy (fp8) cache.
    if span.num_computed == 0:
        keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H_kv, T, D]
        if not HAS_SDPA_GQA:
            num_groups = q.shape[1] // num_kv_heads
            keys, values = repeat_kv(keys, num_groups), repeat_kv(values, num_groups)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys,
            values,
            is_causal=True,
            scale=scale,
            **GQA_KWARGS,
        )  # [1, H, T, D]
        return out[0].transpose(0, 1)
    if span.mask is None:
        raise ValueError("a prefill chunk over cached KV needs its mask (see chunk_mask)")
    # Earlier tokens (prefix cache or earlier chunks) come from the cache.
    num_context = span.num_computed + span.num_tokens
    keys = k_cache.gather(span.block_table, 1, q.dtype)[0, :, :num_context]  # [H_kv, ctx, D]
    values = v_cache.gather(span.block_table, 1, q.dtype)[0, :, :num_context]
    out = F.scaled_dot_product_attention(
        grouped(q, num_kv_heads), keys, values, attn_mask=span.mask, scale=scale
    )  # [H_kv, G * T, D]
    return ungrouped(out, span.num_tokens)
