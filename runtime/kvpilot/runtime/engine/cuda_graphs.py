"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured at start-up
into one shared memory pool (largest first, so the smaller ones reuse its blocks), as vLLM and
nano-vllm do. At small batches an eager decode step is bound by its kernel launches (hundreds
per step); a replay launches them all at once.

What each graph runs is engine/decode_graphs.py's `StaticDecode.forward`, the path the CPU tests
run eagerly against the unpadded step; here it is only recorded and replayed. Attention is
FlashInfer's decode wrapper in its CUDA-graph mode (one wrapper per bucket, its page lists in
static buffers that `plan` refills before each replay) where FlashInfer is the backend, the SDPA
decode group otherwise. Prefill, mixed steps and batches larger than the largest bucket run
eagerly (decode_graphs.graph_rows).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.decode_graphs import (
    PaddedDecode,
    StaticDecode,
    batch_buckets,
    sdpa_buckets,
    unpad,
)
from kvpilot.runtime.engine.model_runner import ModelRunner, StepPlan
from kvpilot.runtime.layers.flashinfer_attention import FlashInferAttention, FlashInferStep

log = logging.getLogger("kvpilot.engine")
# Eager runs before each capture: lazy initialisation (cuBLAS handles, kernels' first loads)
# must happen outside the graph.
WARMUP_RUNS = 2


class CudaGraphRunner:
    """Captured decode graphs; `run` replays the one a step fits, None where it fits none."""

    def __init__(self, static: StaticDecode, flashinfer: FlashInferAttention | None) -> None:
        self.static, self.flashinfer = static, flashinfer
        self.wrappers: dict[int, Any] = {}  # bucket -> FlashInfer's graph decode wrapper
        if flashinfer is not None:
            for bucket in static.buckets:
                self.wrappers[bucket] = flashinfer.graph_decode(bucket, static.max_blocks)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> [bucket, hidden], the graph's
        self.capture_seconds, self.capture_bytes = 0.0, 0  # what `capture` took

    def capture(self) -> None:
        """Record every bucket's step, largest first; time it and the device memory taken."""
        torch.cuda.synchronize()
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.static.buckets, reverse=True):
            empty = StepPlan([], [], [], [], [], [], [])  # every row padding: the scratch block
            flashinfer = self._plan(bucket, self.static.fill(empty, bucket))
            for _ in range(WARMUP_RUNS):
                self.static.forward(bucket, flashinfer)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.static.forward(bucket, flashinfer)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = free_before - torch.cuda.mem_get_info()[0]

    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """The sampled rows' hidden states [S, hidden] of a decode step, replayed; None where
        the step must run eagerly."""
        bucket = self.static.bucket_for(plan)
        if bucket is None:
            return None
        self._plan(bucket, self.static.fill(plan, bucket))
        self.graphs[bucket].replay()
        return unpad(self.outputs[bucket], plan.sample_rows)

    def _plan(self, bucket: int, padded: PaddedDecode) -> FlashInferStep | None:
        """FlashInfer's page lists for the filled bucket (host-side scheduling, outside the
        graph), None on the SDPA path (its metadata is computed inside the graph)."""
        if self.flashinfer is None:
            return None
        wrapper = self.wrappers[bucket]
        return self.flashinfer.plan_graph_decode(wrapper, padded.block_tables, padded.context_lens)


def capture_decode_graphs(
    runner: ModelRunner, max_num_seqs: int, max_model_len: int
) -> tuple[CudaGraphRunner, str]:
    """The runner's decode graphs for up to max_num_seqs rows, captured once its pool is
    allocated (with the scratch block: ModelRunner(cuda_graphs=True)), and a line for the
    start-up log saying what they cost (seconds, device memory)."""
    model, flashinfer = runner.model, runner.flashinfer
    max_blocks = -(-max_model_len // BLOCK_SIZE)
    buckets = batch_buckets(max_num_seqs)
    if flashinfer is None:
        cfg = model.cfg
        block_bytes = BLOCK_SIZE * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
        buckets = sdpa_buckets(buckets, max_blocks, block_bytes)
    # The scratch block lies past the blocks the block manager hands out.
    static = StaticDecode(model, runner.kv_caches, buckets, max_blocks, runner.num_kv_blocks)
    graphs = CudaGraphRunner(static, flashinfer)
    graphs.capture()
    path = "FlashInfer" if flashinfer is not None else "SDPA"
    summary = (
        f"CUDA graphs: {len(buckets)} decode buckets of 1-{buckets[-1]} rows ({path}) captured "
        f"in {graphs.capture_seconds:.1f} s, {graphs.capture_bytes / 2**20:.0f} MiB of device "
        "memory"
    )
    if buckets[-1] < max_num_seqs:
        summary += f"; larger decode batches run eagerly (the SDPA gather of {max_blocks} blocks)"
    log.info(summary)
    return graphs, summary
