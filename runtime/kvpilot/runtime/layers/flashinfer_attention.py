"""Attention on CUDA through FlashInfer's paged kernels (`flashinfer-python`), read in place.

FlashInfer takes the KV cache as the pool already stores it: per layer a (keys, values) pair of
[num_pages, page_size, H_kv, D] ("NHD"), a page being one of our blocks, so nothing is copied
out. A step is planned once (`FlashInferAttention.plan`: which pages each row reads, scheduled
by FlashInfer on the host) and run by every layer, as vLLM and SGLang drive it:
- the decode rows (rows 0..B-1; a proposal row is a row of its own, with its own length) through
  `BatchDecodeWithPagedKVCacheWrapper`;
- the prefill chunks (the rows after them, chunk after chunk) through
  `BatchPrefillWithPagedKVCacheWrapper`, causal with the query aligned to the end of its context
  (query i of a chunk over c cached tokens sees keys <= c + i), as `attention.chunk_mask` is.

A bench/GPU dependency, never a requirement: `--attention-backend auto` picks it on CUDA where it
imports (`unavailable_reason` says why not), torch's SDPA otherwise. The model computes in float16
or bfloat16; the KV cache is in that dtype or fp8 (e4m3, stored value / scale, kv_cache.py), which
FlashInfer's kernels read as they are, given the per-layer scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.runtime.layers.kv_cache import PagedCache, is_fp8

# The float workspace FlashInfer's kernels split long contexts into; vLLM allocates the same
# 128 MiB once per process. Decode and prefill share it: a step runs them one after the other.
WORKSPACE_BYTES = 128 * 1024 * 1024
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# Head sizes FlashInfer compiles its decode and prefill kernels for.
HEAD_DIMS = (64, 128, 256)
# Query heads per KV head from which decode runs on the prefill (tensor-core) kernel: FlashInfer's
# own advice, and vLLM's choice, for grouped-query attention with groups of 4 and more.
TENSOR_CORE_GROUP = 4


def unavailable_reason(
    device: torch.device, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype
) -> str | None:
    """None where FlashInfer can run this model's attention over a KV cache in `kv_dtype`;
    otherwise why not, and what to do."""
    if device.type != "cuda":
        return f"FlashInfer's kernels run on CUDA, not {device.type}"
    if dtype not in KERNEL_DTYPES:
        return f"FlashInfer's kernels take float16 or bfloat16 (the model computes in {dtype})"
    if kv_dtype != dtype and not is_fp8(kv_dtype):
        return (
            f"FlashInfer reads the KV cache in the model dtype or fp8, not {kv_dtype} beside a "
            f"{dtype} model: use --kv-cache-dtype auto or fp8"
        )
    if head_dim not in HEAD_DIMS:
        return (
            f"FlashInfer has kernels for head sizes {HEAD_DIMS}, the model's heads are {head_dim}"
        )
    try:
        import flashinfer  # noqa: F401 - only whether it imports
    except ImportError as error:
        return f"flashinfer-python does not import ({error}); pip install flashinfer-python"
    except Exception as error:  # a broken install (CUDA or torch mismatch) must not stop `auto`
        first_line = (str(error).strip().splitlines() or [""])[0]
        return (
            f"flashinfer-python fails to import ({type(error).__name__}: {first_line}); "
            "reinstall it for this torch and CUDA, or pass --attention-backend sdpa"
        )
    return None


def version() -> str:
    import flashinfer

    return str(getattr(flashinfer, "__version__", "unknown"))


@dataclass(frozen=True)
class PagedLayout:
    """Rows' pages in FlashInfer's CSR form: row r reads pages indices[indptr[r]:indptr[r + 1]],
    the last of them up to last_page_len[r] tokens."""

    indptr: list[int]
    indices: list[int]
    last_page_len: list[int]


def paged_layout(block_tables: list[list[int]], kv_lens: list[int], block_size: int) -> PagedLayout:
    """Per row, the blocks holding its first kv_lens[r] tokens (a table may list more, as a
    sequence's blocks for its proposals do)."""
    indptr, indices, last_page_len = [0], [], []
    for table, kv_len in zip(block_tables, kv_lens, strict=True):
        if kv_len < 1:
            raise ValueError(f"a row attends to at least its own token, got kv_len {kv_len}")
        num_pages = math.ceil(kv_len / block_size)
        if num_pages > len(table):
            raise ValueError(f"{kv_len} tokens need {num_pages} blocks, the table has {len(table)}")
        indices += table[:num_pages]
        indptr.append(len(indices))
        last_page_len.append(kv_len - (num_pages - 1) * block_size)
    return PagedLayout(indptr, indices, last_page_len)


def query_indptr(num_tokens: list[int]) -> list[int]:
    """Prefill chunks' rows, one after the other: chunk c is rows [indptr[c], indptr[c + 1])."""
    indptr = [0]
    for count in num_tokens:
        indptr.append(indptr[-1] + count)
    return indptr


@dataclass
class FlashInferStep:
    """One step, planned: every layer calls `attend` with its own q and cache."""

    num_decode_rows: int
    decode: Any  # BatchDecodeWithPagedKVCacheWrapper, planned; None without decode rows
    prefill: Any  # BatchPrefillWithPagedKVCacheWrapper, planned; None without prefill chunks

    def attend(
        self, q: torch.Tensor, k_cache: PagedCache, v_cache: PagedCache, out: torch.Tensor
    ) -> torch.Tensor:
        """q: [T, H, D] -> out; the caches' data [num_blocks, BS, H_kv, D] hold this step's keys
        and values already. fp8 data is value / scale: the kernels multiply the scales back."""
        q = q.contiguous()  # the layer's q is a view into its fused qkv projection
        pages = (k_cache.data, v_cache.data)
        scales: dict[str, float] = {}
        if is_fp8(k_cache.data.dtype):
            scales = {"k_scale": k_cache.scale, "v_scale": v_cache.scale}
        rows = self.num_decode_rows
        if self.decode is not None:
            self.decode.run(q[:rows], pages, out=out[:rows], **scales)
        if self.prefill is not None:
            self.prefill.run(q[rows:], pages, out=out[rows:], **scales)
        return out


class FlashInferAttention:
    """A model runner's FlashInfer state: one workspace and two wrappers, re-planned each step;
    with CUDA graphs, a decode wrapper per graph too (`graph_decode`)."""

    def __init__(
        self,
        device: torch.device,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        block_size: int,
    ) -> None:
        import flashinfer

        self.device, self.dtype, self.kv_dtype = device, dtype, kv_dtype
        self.block_size = block_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.use_tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_GROUP
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    def graph_decode(self, batch_size: int, max_pages_per_row: int) -> Any:
        """A decode wrapper for a CUDA graph of `batch_size` rows: its page lists live in
        buffers of its own that `plan_graph_decode` refills before each replay (FlashInfer's
        use_cuda_graph mode). It shares the float workspace: one step runs at a time."""
        import flashinfer

        def buffer(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int32, device=self.device)

        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=buffer(batch_size + 1),
            paged_kv_indices_buffer=buffer(batch_size * max_pages_per_row),
            paged_kv_last_page_len_buffer=buffer(batch_size),
        )

    def plan_graph_decode(
        self, wrapper: Any, tables: list[list[int]], lens: list[int]
    ) -> FlashInferStep:
        """A graph's decode rows planned (all of its rows, padding included)."""
        self._plan_decode(wrapper, tables, lens)
        return FlashInferStep(len(tables), wrapper, None)

    def _plan_decode(self, wrapper: Any, tables: list[list[int]], lens: list[int]) -> None:
        layout = paged_layout(tables, lens, self.block_size)
        wrapper.plan(
            *self._tensors(layout),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            pos_encoding_mode="NONE",  # the model applies rotary embeddings itself
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
            sm_scale=self.scale,
        )

    def plan(
        self,
        decode_tables: list[list[int]],
        decode_lens: list[int],
        prefills: list[tuple[int, int, list[int]]],
    ) -> FlashInferStep:
        """decode rows' (table, context length incl. their own token); prefill chunks'
        (num_tokens, num_computed, table), in row order."""
        decode = prefill = None
        if decode_tables:
            self._plan_decode(self.decode, decode_tables, decode_lens)
            decode = self.decode
        if prefills:
            num_tokens = [count for count, _, _ in prefills]
            kv_lens = [count + computed for count, computed, _ in prefills]
            layout = paged_layout([table for _, _, table in prefills], kv_lens, self.block_size)
            self.prefill.plan(
                self._int32(query_indptr(num_tokens)),
                *self._tensors(layout),
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.block_size,
                causal=True,
                sm_scale=self.scale,
                q_data_type=self.dtype,
                kv_data_type=self.kv_dtype,
            )
            prefill = self.prefill
        return FlashInferStep(len(decode_tables), decode, prefill)

    def _tensors(self, layout: PagedLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            self._int32(layout.indptr),
            self._int32(layout.indices),
            self._int32(layout.last_page_len),
        )

    def _int32(self, values: list[int]) -> torch.Tensor:
        # On the host: plan() reads the index pointers there (scheduling is host-side) and
        # copies what the kernels read to the GPU itself, so a GPU tensor costs a sync.
        return torch.tensor(values, dtype=torch.int32)
