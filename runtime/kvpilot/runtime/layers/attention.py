"""Paged attention in plain torch (CPU and CUDA).

The KV cache of a layer is [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim] for keys and for
values. New keys/values are written at `slot_mapping` (block_id * BLOCK_SIZE + offset); attention
reads a sequence's context back by gathering its block table. Decodes are batched into one gather;
prefill chunks run one sequence at a time, so no query padding is wasted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the torch convention

# SDPA shares K/V heads itself from torch 2.5 on (twice as fast as copying them on CPU).
HAS_SDPA_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)
GQA_KWARGS: dict[str, Any] = {"enable_gqa": True} if HAS_SDPA_GQA else {}


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the flat token batch
    num_tokens: int  # query length
    num_computed: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks_of_seq] long


@dataclass
class DecodeGroup:
    """Decodes of similar context length, batched into one gather (less padding to copy)."""

    rows: torch.Tensor  # [B] long, rows of these decode tokens in the flat batch
    block_tables: torch.Tensor  # [B, max_blocks] long (padded with 0)
    context_lens: torch.Tensor  # [B] long


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)


def repeat_kv(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[B, H_kv, L, D] -> [B, H_kv * num_groups, L, D] for grouped-query attention."""
    return x if num_groups == 1 else x.repeat_interleave(num_groups, dim=1)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, H_kv, D] stored at their slots of the [num_blocks, BLOCK_SIZE, H_kv, D] caches."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, BS, H_kv, D] by [B, max_blocks] -> [B, H_kv, max_blocks * BS, D]."""
    gathered = cache[block_tables]  # [B, max_blocks, BS, H_kv, D]
    return gathered.flatten(1, 2).transpose(1, 2)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, H_kv, D] -> [T, H, D]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    num_groups = q.shape[1] // k.shape[1]
    for group in meta.decodes:
        out[group.rows] = _decode(q[group.rows], k_cache, v_cache, group, num_groups, scale)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, span, num_groups, scale)
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
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    num_groups: int,
    scale: float,
) -> torch.Tensor:
    """q: [B, H, D], one query per sequence -> [B, H, D]."""
    num_seqs, num_heads, head_dim = q.shape
    keys = gather_kv(k_cache, group.block_tables)  # [B, H_kv, L, D]
    values = gather_kv(v_cache, group.block_tables)
    positions = torch.arange(keys.shape[2], device=q.device)
    mask = positions[None, :] < group.context_lens[:, None]  # [B, L]
    q_grouped = q.view(num_seqs, keys.shape[1], num_groups, head_dim)  # [B, H_kv, G, D]
    out = F.scaled_dot_product_attention(
        q_grouped, keys, values, attn_mask=mask[:, None, None, :], scale=scale
    )  # [B, H_kv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: PrefillSpan,
    num_groups: int,
    scale: float,
) -> torch.Tensor:
    """One sequence's chunk. q: [T, H, D], k/v: [T, H_kv, D] -> [T, H, D]."""
    if span.num_computed == 0:  # the whole context is this chunk: plain causal attention
        keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H_kv, T, D]
        if not HAS_SDPA_GQA:
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
    # Earlier tokens (prefix cache or earlier chunks) come from the cache.
    num_context = span.num_computed + span.num_tokens
    keys = gather_kv(k_cache, span.block_table[None])[0, :, :num_context]  # [H_kv, ctx, D]
    values = gather_kv(v_cache, span.block_table[None])[0, :, :num_context]
    mask = torch.ones(span.num_tokens, num_context, dtype=torch.bool, device=q.device)
    mask = mask.tril(diagonal=span.num_computed)  # query i sees keys <= num_computed + i
    out = F.scaled_dot_product_attention(
        grouped(q, k.shape[1]), keys, values, attn_mask=mask.repeat(num_groups, 1), scale=scale
    )  # [H_kv, G * T, D]
    return ungrouped(out, span.num_tokens)
