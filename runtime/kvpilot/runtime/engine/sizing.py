"""How the engine sizes itself: its hardware choices, the longest context it serves and its KV
pool. Functions of the config, the checkpoint's config.json and the machine, returning values."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.contract import memory
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine import machine, machine_files
from kvpilot.runtime.engine.parallel import rank_device
from kvpilot.runtime.layers import flashinfer_attention, paged_kernel
from kvpilot.runtime.layers.attention import resolve_attention_backend
from kvpilot.runtime.layers.kv_cache import resolve_kv_cache_dtype
from kvpilot.runtime.layers.quant import resolve_int8_kernel
from kvpilot.runtime.models.loader import ModelConfig, resolve_dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


def model_facts(cfg: ModelConfig) -> memory.ModelFacts:
    return memory.ModelFacts(
        parameters=cfg.num_parameters,
        layers=cfg.num_layers,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
    )


def resolve_max_model_len(config: EngineConfig, cfg: ModelConfig) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:  # full attention equals sliding-window attention inside the window
        limit = min(limit, cfg.sliding_window)
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit {limit}")
    return config.max_model_len or limit


@dataclass(frozen=True)
class Hardware:
    """What rank 0 computes with and on, each chosen from the config and what the machine has
    (the start-up log and /version name them)."""

    device: torch.device
    # Bytes this process may use on a CPU (None on a GPU, or unknown), read before the weights
    # load: they take their share of it, which the KV budget subtracts.
    usable_memory: int | None
    cpu_has_bf16: bool
    dtype: torch.dtype
    kv_dtype: torch.dtype
    cpu_has_int8_dot: bool
    int8_kernel: str
    attention_backend: str
    attention_source: str
    num_threads: int  # this rank's share of the threads torch was given


def resolve_hardware(config: EngineConfig, cfg: ModelConfig) -> Hardware:
    """Rank 0's choices, before the weights load: an unsupported KV dtype or kernel fails in a
    second, not a minute. Reads the machine (CPU flags, usable memory, kernels), changes nothing."""
    tp = config.tensor_parallel_size
    device = resolve_device(config.device)
    if tp > 1:
        device = rank_device(device, 0, tp)
    usable_memory = machine_files.usable_memory() if device.type == "cpu" else None
    cpu_flags = machine_files.cpu_flags()  # /proc/cpuinfo, read once
    cpu_has_bf16 = machine.cpu_supports_bf16(cpu_flags)
    dtype = resolve_dtype(config.dtype, cfg.torch_dtype, device, cpu_has_bf16)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
    cpu_has_int8_dot = machine.cpu_supports_int8_dot(cpu_flags)
    int8_kernel = resolve_int8_kernel(config.int8_kernel, device, cpu_has_int8_dot)
    backend, source = resolve_attention(config.attention_backend, cfg, device, dtype, kv_dtype)
    # Each rank, this one included, computes with its share of the threads torch was given.
    num_threads = machine.threads_per_rank(torch.get_num_threads(), tp)
    return Hardware(
        device, usable_memory, cpu_has_bf16, dtype, kv_dtype, cpu_has_int8_dot, int8_kernel,
        backend, source, num_threads,
    )  # fmt: skip


def resolve_attention(
    choice: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype
) -> tuple[str, str]:
    """The decode attention backend and why it was chosen (FlashInfer's with its release)."""
    backend, source = resolve_attention_backend(
        choice, device, kv_dtype == dtype, paged_kernel.unavailable_reason,
        lambda: flashinfer_attention.unavailable_reason(device, dtype, cfg.head_dim, kv_dtype),
    )  # fmt: skip
    if backend == "flashinfer":  # /version and the log name the release
        source += f" (flashinfer-python {flashinfer_attention.version()})"
    return backend, source


@dataclass(frozen=True)
class MemoryRoom:
    """The memory a rank's KV pool is cut from: a GPU's total, or on a CPU what this process may
    use (None when unknown), and the bytes of it the weights take (a draft model's included)."""

    device: torch.device
    gpu_total: int | None
    usable: int | None
    weight_bytes: int


@dataclass(frozen=True)
class KvBudget:
    """Bytes for the KV pool, and where they come from (the start-up log names it)."""

    bytes: float
    source: str


@dataclass(frozen=True)
class KvPool:
    """A rank's KV pool: its blocks, and the budget that sized them."""

    num_blocks: int
    budget: KvBudget


def gpu_total_memory(device: torch.device) -> int | None:
    """A GPU's memory in bytes; None on a CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def blocks_for(tokens: int) -> int:
    return -(-tokens // memory.BLOCK_SIZE)


def size_kv_pool(
    config: EngineConfig,
    room: MemoryRoom,
    max_model_len: int,
    rank: memory.ModelFacts,
    draft: memory.ModelFacts | None,
    kv_bytes: int,
) -> KvPool:
    """Pool size from the shared memory arithmetic (DESIGN.md §3.3), at `kv_bytes` per element
    of the KV storage dtype: fp8 holds twice the blocks of bf16 in the same budget. The budget is
    per rank (per GPU), and so is the pool: each rank caches only its own KV heads (`rank`, its
    share of them); `draft`: a draft model's, whole. ValueError when one sequence cannot fit."""
    # A draft model's KV cache has as many blocks as the served model's: the budget holds
    # both, so each block costs (1 + draft_share) of the served model's bytes.
    kv_scale = 1 + memory.draft_kv_share(rank, draft, kv_bytes)
    needed = blocks_for(max_model_len)
    demand = memory.kv_cache_bytes(rank, kv_bytes, needed * memory.BLOCK_SIZE, config.max_num_seqs)
    budget = kv_budget(config, room, int(demand * kv_scale))
    num_blocks = memory.num_kv_blocks(rank, kv_bytes, budget.bytes / kv_scale)
    if num_blocks < needed:
        raise ValueError(
            f"KV-cache budget of {budget.bytes / 2**20:.1f} MiB ({budget.source}) holds "
            f"{num_blocks} blocks; one sequence of max_model_len {max_model_len} needs "
            f"{needed}: pass a smaller --max-model-len or a larger --kv-cache-memory"
        )
    return KvPool(num_blocks, budget)


def kv_budget(config: EngineConfig, room: MemoryRoom, demand: int) -> KvBudget:
    """--kv-cache-memory when given; else --gpu-memory-utilization of the GPU's memory, less
    weights and overhead; else of the memory this process may use, and on a host no more than
    `demand` (the bytes max_num_seqs sequences of max_model_len fill)."""
    if config.kv_cache_memory is not None:
        check_kv_cache_memory(config.kv_cache_memory, room)
        return KvBudget(config.kv_cache_memory, "--kv-cache-memory")
    utilization = config.gpu_memory_utilization
    if room.gpu_total is None:
        return host_kv_budget(utilization, room, demand)
    budget = memory.kv_budget_bytes(room.gpu_total, utilization, room.weight_bytes)
    return KvBudget(budget, f"{utilization:g} of {memory.gib(room.gpu_total):.1f} GiB GPU memory")


def host_kv_budget(utilization: float, room: MemoryRoom, demand: int) -> KvBudget:
    if room.usable is None:
        raise ValueError(
            "cannot tell how much memory this process may use (no cgroup memory limit, no "
            "MemAvailable in /proc/meminfo): pass --kv-cache-memory BYTES"
        )
    budget = memory.host_kv_budget_bytes(room.usable, utilization, room.weight_bytes, demand)
    usable = f"{utilization:g} of {memory.gib(room.usable):.1f} GiB usable memory"
    if budget >= demand:
        return KvBudget(budget, f"max_num_seqs x max_model_len, under {usable}")
    return KvBudget(budget, f"{usable}, less weights and overhead")


def check_kv_cache_memory(requested: int, room: MemoryRoom) -> None:
    """A --kv-cache-memory larger than the device can hold beside the weights fails here,
    saying so, not as an allocator error naming no flag (CPU) or a CUDA OOM."""
    capacity: int | None = room.gpu_total
    where = f"GPU {room.device} memory"
    if capacity is None:
        where, capacity = "the memory this process may use", room.usable
    if capacity is None:
        return  # nothing to check against (no cgroup limit, no MemAvailable)
    error = memory.kv_cache_memory_error(requested, capacity, room.weight_bytes, where)
    if error is not None:
        raise ValueError(error)
