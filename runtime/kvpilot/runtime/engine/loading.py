"""What the engine loads at start: its tensor-parallel workers, rank 0's shard of the model, a
draft model, and the KV pools, sized from the memory the weights leave."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kvpilot.contract.engine_config import EngineConfig
from kvpilot.contract.speculative_config import SpeculativeConfig
from kvpilot.runtime.engine import speculative
from kvpilot.runtime.engine.decode_graphs import graphs_off_reason
from kvpilot.runtime.engine.draft_model import DraftModelProposer, load_draft
from kvpilot.runtime.engine.model_runner import ModelRunner, load_model
from kvpilot.runtime.engine.parallel import TPGroup
from kvpilot.runtime.engine.sizing import (
    Hardware,
    KvPool,
    MemoryRoom,
    gpu_total_memory,
    model_facts,
    size_kv_pool,
)
from kvpilot.runtime.engine.worker import WorkerArgs, WorkerPool, start_workers
from kvpilot.runtime.models.loader import ModelConfig

log = logging.getLogger("kvpilot.engine")


@dataclass(frozen=True)
class LoadedModels:
    """Rank 0's models, their KV caches allocated."""

    runner: ModelRunner
    proposer: speculative.Proposer | None  # None: speculative decoding is off
    weight_bytes: int  # per rank, a draft model's included
    kv_pool: KvPool


def start_rank_workers(
    config: EngineConfig, model_config: ModelConfig, hardware: Hardware
) -> WorkerPool:
    """Ranks 1 and up of the tensor-parallel group, one process each, loading their shards."""
    args = WorkerArgs(
        model_dir=Path(config.model),
        model_config=model_config,
        quantization=config.quantization,
        int8_kernel=hardware.int8_kernel,
        attention_backend=hardware.attention_backend,
        dtype=hardware.dtype,
        device=hardware.device,
        seed=config.seed,
        group=TPGroup(0, config.tensor_parallel_size),
        init_method="",  # chosen by start_workers
        parent_pid=os.getpid(),
        num_threads=hardware.num_threads,
    )
    return start_workers(args)


def load_models(
    config: EngineConfig,
    model_config: ModelConfig,
    hardware: Hardware,
    max_model_len: int,
    spec_config: SpeculativeConfig | None,
    workers: WorkerPool | None,
    eos_token_ids: tuple[int, ...],
) -> LoadedModels:
    """This rank's shard of the model and KV pool; with workers, theirs alongside."""
    group = TPGroup(0, config.tensor_parallel_size)
    model = load_model(
        Path(config.model),
        model_config,
        config.quantization,
        hardware.dtype,
        hardware.device,
        group,
        hardware.int8_kernel,
    )
    if workers is not None:
        workers.join_group(group, hardware.device)
    weight_bytes = model.weight_bytes()  # per rank
    if config.enable_lora:  # the adapter slots take memory beside the weights
        weight_bytes += model.enable_lora(config.max_loras, config.max_lora_rank).num_bytes()
        if workers is not None:  # each rank holds its shard of every slot
            workers.enable_lora(config.max_loras, config.max_lora_rank)
    graphs_off = graphs_off_reason(
        config.enforce_eager, hardware.device, config.tensor_parallel_size
    )
    runner = ModelRunner(
        model, hardware.device, config.seed, workers, eos_token_ids, hardware.attention_backend,
        cuda_graphs=graphs_off is None,
    )  # fmt: skip
    proposer = load_proposer(config, hardware, max_model_len, spec_config)
    if isinstance(proposer, DraftModelProposer):  # its weights count in the memory budget too
        weight_bytes += proposer.runner.model.weight_bytes()
    pool = size_rank_kv_pool(config, hardware, max_model_len, runner, proposer, weight_bytes)
    runner.allocate_kv_cache(pool.num_blocks, hardware.kv_dtype)
    if graphs_off is None:  # after the pool: the graphs read its addresses
        from kvpilot.runtime.engine import cuda_graphs  # CUDA-only

        runner.graphs, _ = cuda_graphs.capture_decode_graphs(
            runner, config.max_num_seqs, max_model_len
        )
    else:
        log.info("CUDA graphs off, decode runs eagerly: %s", graphs_off)
    if isinstance(proposer, DraftModelProposer):
        proposer.runner.allocate_kv_cache(pool.num_blocks, hardware.kv_dtype)
    return LoadedModels(runner, proposer, weight_bytes, pool)


def load_proposer(
    config: EngineConfig,
    hardware: Hardware,
    max_model_len: int,
    spec_config: SpeculativeConfig | None,
) -> speculative.Proposer | None:
    """Where proposals come from (speculative decoding), None when it is off."""
    if spec_config is None:
        return None
    if spec_config.model is None:
        return speculative.NgramProposer(spec_config)
    return load_draft(
        Path(spec_config.model), Path(config.model), max_model_len, hardware.dtype,
        hardware.device, config.seed, hardware.attention_backend, hardware.kv_dtype,
    )  # fmt: skip


def size_rank_kv_pool(
    config: EngineConfig,
    hardware: Hardware,
    max_model_len: int,
    runner: ModelRunner,
    proposer: speculative.Proposer | None,
    weight_bytes: int,
) -> KvPool:
    """Rank 0 sizes the pool for every rank, so the ranks' GPUs are taken to be alike (one per
    replica type); rank 0 is the fullest, with the draft model's weights and whole KV cache if
    there is one."""
    gpu_total = gpu_total_memory(hardware.device)
    room = MemoryRoom(hardware.device, gpu_total, hardware.usable_memory, weight_bytes)
    rank_facts = model_facts(runner.model.cfg)  # this rank's share of the KV heads
    draft_facts = None
    if isinstance(proposer, DraftModelProposer):
        draft_facts = model_facts(proposer.model_config)
    kv_bytes = hardware.kv_dtype.itemsize
    return size_kv_pool(config, room, max_model_len, rank_facts, draft_facts, kv_bytes)
