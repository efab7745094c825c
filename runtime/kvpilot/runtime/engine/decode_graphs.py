"""Decode steps at a few fixed batch sizes over buffers filled in place: what a CUDA graph
records and replays (engine/cuda_graphs.py), kept free of CUDA so the CPU tests run it eagerly.

A graph replays the kernels it recorded on the same addresses with the same shapes, so a decode
step run through one has one of a few batch sizes (`batch_buckets`, vLLM's capture sizes), reads
its inputs from buffers allocated once (`DecodeBuffers`) and builds its attention metadata from
views of them. A step of B decode rows runs in the smallest bucket >= B; the rows past B are
padding: token 0 at position 0, whose key and value are written to the scratch block (one block
past the pool's last, allocated for them alone and never handed to a sequence) and which attend
to that block only, so they never write or read a real block. Their outputs are dropped.

Every row's block table is padded to the graph's width, `max_blocks`, with the scratch block:
the SDPA path gathers that width for every row (masked past each row's context), FlashInfer
reads only each row's own pages.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.model_runner import StepPlan
from kvpilot.runtime.layers.attention import AttentionMetadata, DecodeGroup, decode_mask
from kvpilot.runtime.layers.flashinfer_attention import FlashInferStep
from kvpilot.runtime.models.llama import KVCache, LlamaModel

BUCKET_STEP = 8  # vLLM's capture sizes: 1, 2, 4, then every multiple of 8
# The SDPA path's graphs gather every row's whole width of keys and values per layer; buckets
# whose gather would take more than this stay eager (FlashInfer reads the pages in place).
SDPA_GRAPH_GATHER_BYTES = 1 << 30


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, ... below max_num_seqs, then max_num_seqs itself: every batch of
    decodes the scheduler can form fits one."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [size for size in (1, 2, 4) if size < max_num_seqs]
    sizes += range(BUCKET_STEP, max_num_seqs, BUCKET_STEP)
    return (*sizes, max_num_seqs)


def sdpa_buckets(buckets: tuple[int, ...], max_blocks: int, block_bytes: int) -> tuple[int, ...]:
    """The buckets whose SDPA gather (keys and values of `max_blocks` blocks per row, `block_bytes`
    each in the model dtype) fits SDPA_GRAPH_GATHER_BYTES; bucket 1 always does."""
    row_bytes = 2 * max_blocks * block_bytes
    return tuple(b for b in buckets if b == 1 or b * row_bytes <= SDPA_GRAPH_GATHER_BYTES)


def choose_bucket(buckets: tuple[int, ...], num_rows: int) -> int | None:
    """The smallest bucket holding num_rows (buckets ascending); None when none does."""
    index = bisect.bisect_left(buckets, num_rows)
    return buckets[index] if index < len(buckets) else None


def graph_rows(plan: StepPlan, max_blocks: int) -> int | None:
    """The rows of a step a decode graph can run, None where it must run eagerly: a graph holds
    decode rows only (proposal rows included), every output a sampled row's, no adapter, and
    block tables within its width."""
    if plan.prefills or plan.prompt_rows or plan.lora_slots or not plan.input_ids:
        return None
    if any(len(table) > max_blocks for table in plan.decode_block_tables):
        return None
    return len(plan.input_ids)


@dataclass(frozen=True)
class PaddedDecode:
    """A decode step's inputs padded to its bucket: every list has `bucket` rows."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    context_lens: list[int]  # tokens each row attends to, its own included
    block_tables: list[list[int]]  # [bucket][max_blocks], padded with the scratch block


def pad_decode(plan: StepPlan, bucket: int, max_blocks: int, scratch_block: int) -> PaddedDecode:
    """The plan's decode rows, then padding rows that write to and read only `scratch_block`."""
    num_pad = bucket - len(plan.input_ids)
    if num_pad < 0:
        raise ValueError(f"{len(plan.input_ids)} decode rows do not fit bucket {bucket}")
    tables = [table + [scratch_block] * (max_blocks - len(table))
              for table in plan.decode_block_tables]  # fmt: skip
    return PaddedDecode(
        input_ids=plan.input_ids + [0] * num_pad,
        positions=plan.positions + [0] * num_pad,
        slot_mapping=plan.slot_mapping + [scratch_block * BLOCK_SIZE] * num_pad,
        context_lens=plan.decode_context_lens + [1] * num_pad,
        block_tables=tables + [[scratch_block] * max_blocks for _ in range(num_pad)],
    )


class DecodeBuffers:
    """The inputs of every bucket's step, allocated once for the largest: a bucket of b rows
    reads rows [0, b). `fill` copies a padded step in place, so the addresses a graph recorded
    stay valid."""

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device) -> None:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.input_ids, self.positions = zeros(max_rows), zeros(max_rows)  # [R]
        self.slot_mapping, self.context_lens = zeros(max_rows), zeros(max_rows)  # [R]
        self.block_tables = zeros(max_rows, max_blocks)  # [R, W]

    def fill(self, padded: PaddedDecode) -> None:
        rows = len(padded.input_ids)
        columns = (padded.input_ids, padded.positions, padded.slot_mapping, padded.context_lens)
        host = torch.tensor(columns, dtype=torch.long)  # [4, rows]: one copy from Python lists
        for buffer, values in zip(self._vectors(), host, strict=True):
            buffer[:rows].copy_(values)
        self.block_tables[:rows].copy_(torch.tensor(padded.block_tables, dtype=torch.long))

    def _vectors(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.positions, self.slot_mapping, self.context_lens

    def metadata(
        self, rows: int, dtype: torch.dtype, flashinfer: FlashInferStep | None
    ) -> AttentionMetadata:
        """Attention metadata of the first `rows` rows, views of the buffers: FlashInfer's
        planned step (its own static buffers), or one SDPA decode group whose mask is computed
        from the context lengths (inside a graph, so it is recorded too)."""
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:rows])
        if flashinfer is not None:
            meta.flashinfer = flashinfer
            return meta
        tables = self.block_tables[:rows]  # [b, W], contiguous rows
        mask = decode_mask(self.context_lens[:rows], tables.shape[1] * BLOCK_SIZE, dtype)
        meta.decodes = [DecodeGroup(0, tables.reshape(-1), mask)]
        return meta


class StaticDecode:
    """The model's decode step over `DecodeBuffers`, per bucket: run eagerly here, recorded and
    replayed by cuda_graphs.CudaGraphRunner. `scratch_block` lies past the blocks that the block
    manager hands out."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: KVCache,
        buckets: tuple[int, ...],
        max_blocks: int,
        scratch_block: int,
    ) -> None:
        if scratch_block >= kv_caches[0][0].data.shape[0]:
            raise ValueError(
                f"scratch block {scratch_block} is outside the KV pool: allocate it with "
                "ModelRunner(cuda_graphs=True)"
            )
        self.model, self.kv_caches, self.buckets = model, kv_caches, buckets
        self.max_blocks, self.scratch_block = max_blocks, scratch_block
        self.buffers = DecodeBuffers(buckets[-1], max_blocks, model.device)

    def bucket_for(self, plan: StepPlan) -> int | None:
        rows = graph_rows(plan, self.max_blocks)
        return None if rows is None else choose_bucket(self.buckets, rows)

    def fill(self, plan: StepPlan, bucket: int) -> PaddedDecode:
        padded = pad_decode(plan, bucket, self.max_blocks, self.scratch_block)
        self.buffers.fill(padded)
        return padded

    def forward(self, bucket: int, flashinfer: FlashInferStep | None = None) -> torch.Tensor:
        """The filled bucket's final hidden states, padding rows included: [bucket, hidden]."""
        buffers = self.buffers
        meta = buffers.metadata(bucket, self.model.dtype, flashinfer)
        ids, positions = buffers.input_ids[:bucket], buffers.positions[:bucket]
        return self.model.forward(ids, positions, self.kv_caches, meta)

    def run_eager(self, plan: StepPlan) -> torch.Tensor | None:
        """The step's sampled rows' hidden states [S, hidden] as a graph would give them, run
        eagerly (SDPA); None where the step does not fit a bucket."""
        bucket = self.bucket_for(plan)
        if bucket is None:
            return None
        self.fill(plan, bucket)
        return unpad(self.forward(bucket), plan.sample_rows)


def unpad(hidden: torch.Tensor, sample_rows: list[int]) -> torch.Tensor:
    """hidden: [bucket, hidden] -> [S, hidden], the sampled rows in batch order (as the eager
    step's output rows are); padding rows are never among them."""
    return hidden[torch.tensor(sample_rows, dtype=torch.long, device=hidden.device)]


def graphs_off_reason(
    enforce_eager: bool, device: torch.device, tensor_parallel_size: int
) -> str | None:
    """Why decode runs eagerly on this engine, None where CUDA graphs are captured."""
    if enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return f"CUDA graphs are CUDA-only; decode runs eagerly on {device.type}"
    if tensor_parallel_size > 1:
        return "not yet captured under tensor parallelism; every rank runs eagerly"
    return None
