"""The machine-derived defaults (engine/machine.py, loader.resolve_dtype,
memory.host_kv_budget_bytes, engine_sizing's KV budget and pool) decided from the text of fake /proc
and cgroup files and the memory a machine reports: one row per kind of machine."""

from __future__ import annotations

import pytest
import torch

from kvpilot.contract import memory
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine import machine, sizing
from kvpilot.runtime.models.loader import resolve_dtype

GIB = 2**30
ZEN4_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
processor\t: 1
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
"""
SAPPHIRE_RAPIDS_CPUINFO = "flags\t\t: avx2 avx512f amx_tile amx_bf16 amx_int8\n"
SKYLAKE_CPUINFO = "flags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
GRAVITON3_CPUINFO = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
MEMINFO = "MemTotal:       32000000 kB\nMemFree:  1000 kB\nMemAvailable:   20971520 kB\n"


@pytest.mark.parametrize(
    ("cpu_max_v2", "quota_v1", "period_v1", "expected"),
    [
        ("max 100000\n", None, None, None),  # v2, no limit
        ("150000 100000\n", None, None, 1.5),  # v2, a 1500m pod limit
        ("400000 100000\n", None, None, 4.0),
        (None, "-1\n", "100000\n", None),  # v1, no quota
        (None, "200000\n", "100000\n", 2.0),  # v1, a 2-core limit
        (None, "50000\n", "100000\n", 0.5),
        (None, None, None, None),  # no cgroup files at all (macOS, a bare process)
    ],
)
def test_cgroup_cpu_quota(
    cpu_max_v2: str | None, quota_v1: str | None, period_v1: str | None, expected: float | None
) -> None:
    assert machine.cgroup_cpu_quota(cpu_max_v2, quota_v1, period_v1) == expected


@pytest.mark.parametrize(
    ("requested", "omp", "quota", "affinity", "threads", "source"),
    [
        (None, None, None, 2, 2, "CPU affinity (2 cores)"),
        (None, None, 4.0, 16, 4, "cgroup CPU quota 4 cores"),
        (None, None, 1.5, 16, 1, "cgroup CPU quota 1.5 cores"),  # half a core is no thread
        (None, None, 0.5, 16, 1, "cgroup CPU quota 0.5 cores"),  # at least one
        (None, None, 32.0, 8, 8, "CPU affinity (8 cores)"),  # quota above the CPUs it may use
        (None, "1", None, 8, 1, "OMP_NUM_THREADS"),
        (None, "64", 4.0, 16, 4, "OMP_NUM_THREADS"),  # capped at the cores
        (None, "", None, 8, 8, "CPU affinity (8 cores)"),  # empty: unset
        (3, "1", 4.0, 16, 3, "--threads"),  # the flag wins
        (1, None, None, 1, 1, "--threads"),
    ],
)
def test_choose_threads(
    requested: int | None,
    omp: str | None,
    quota: float | None,
    affinity: int,
    threads: int,
    source: str,
) -> None:
    assert machine.choose_threads(requested, omp, quota, affinity) == machine.ThreadChoice(
        threads, source
    )


@pytest.mark.parametrize(
    ("requested", "quota", "affinity", "message"),
    [
        (3, None, 2, r"--threads 3: this process may use 2 core\(s\) \(CPU affinity \(2 cores\)\)"),
        (4, 2.0, 16, r"may use 2 core\(s\) \(cgroup CPU quota 2 cores\); pass 1\.\.2"),
        (0, None, 2, r"--threads 0"),
    ],
)
def test_threads_above_the_cores_are_refused(
    requested: int, quota: float | None, affinity: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        machine.choose_threads(requested, None, quota, affinity)


@pytest.mark.parametrize(
    ("num_threads", "world_size", "per_rank"),
    [
        (2, 1, 2),
        (2, 2, 1),  # this machine at TP 2: one each, not two each on two cores
        (16, 4, 4),
        (7, 2, 3),  # rounded down: a leftover core is better idle than oversubscribed
        (1, 2, 1),  # at least one
        (3, 4, 1),
    ],
)
def test_threads_per_rank(num_threads: int, world_size: int, per_rank: int) -> None:
    assert machine.threads_per_rank(num_threads, world_size) == per_rank


def test_rank_share_reports_the_split() -> None:
    choice = machine.ThreadChoice(8, "cgroup CPU quota 8 cores")
    assert machine.rank_share(choice, 1) is choice
    assert machine.rank_share(choice, 2) == machine.ThreadChoice(
        4, "cgroup CPU quota 8 cores, split over 2 ranks"
    )


@pytest.mark.parametrize(
    ("cpuinfo", "has_bf16"),
    [
        (ZEN4_CPUINFO, True),
        (SAPPHIRE_RAPIDS_CPUINFO, True),
        (SKYLAKE_CPUINFO, False),
        (GRAVITON3_CPUINFO, False),  # Arm's bf16 is not a flag torch's CPU kernels use here
        ("", False),  # no /proc/cpuinfo
    ],
)
def test_cpu_supports_bf16(cpuinfo: str, has_bf16: bool) -> None:
    assert machine.cpu_supports_bf16(machine.cpu_flags(cpuinfo)) is has_bf16


@pytest.mark.parametrize(
    ("cpuinfo", "has_int8_dot"),
    [
        (ZEN4_CPUINFO, True),  # AVX512-VNNI
        (SAPPHIRE_RAPIDS_CPUINFO, True),  # AMX int8 tiles
        ("flags\t\t: fpu sse2 avx2 avx_vnni\n", True),  # Alder Lake: VNNI on AVX2
        (SKYLAKE_CPUINFO, False),
        (GRAVITON3_CPUINFO, False),  # Arm's i8mm is not a flag torch's x86 kernels use
        ("", False),
    ],
)
def test_cpu_supports_int8_dot(cpuinfo: str, has_int8_dot: bool) -> None:
    assert machine.cpu_supports_int8_dot(machine.cpu_flags(cpuinfo)) is has_int8_dot


@pytest.mark.parametrize(
    ("name", "checkpoint", "device", "cpu_has_bf16", "expected"),
    [
        ("auto", "bfloat16", "cpu", True, torch.bfloat16),
        ("auto", "float16", "cpu", True, torch.bfloat16),  # CPU fp16 kernels are slow
        ("auto", "float32", "cpu", True, torch.float32),  # a float32 checkpoint stays
        ("auto", "bfloat16", "cpu", False, torch.float32),  # no bf16 units: widen once
        ("auto", "float16", "cpu", False, torch.float32),
        ("auto", "float16", "cuda", False, torch.float16),  # GPUs keep the checkpoint's
        ("auto", "bfloat16", "cuda", False, torch.bfloat16),
        ("bfloat16", "float32", "cpu", False, torch.bfloat16),  # explicit: as asked
        ("float32", "bfloat16", "cpu", True, torch.float32),
    ],
)
def test_resolve_dtype(
    name: str, checkpoint: str, device: str, cpu_has_bf16: bool, expected: torch.dtype
) -> None:
    assert resolve_dtype(name, checkpoint, torch.device(device), cpu_has_bf16) == expected


@pytest.mark.parametrize(
    ("memory_max_v2", "limit_v1", "meminfo", "expected"),
    [
        ("max\n", None, MEMINFO, 20 * GIB),  # v2 without a limit: what the host has free
        (f"{8 * GIB}\n", None, MEMINFO, 8 * GIB),  # a pod's 8 GiB limit
        (f"{64 * GIB}\n", None, MEMINFO, 20 * GIB),  # a limit above what is available
        (None, "9223372036854771712\n", MEMINFO, 20 * GIB),  # v1's "no limit"
        (None, f"{4 * GIB}\n", MEMINFO, 4 * GIB),
        (None, f"{4 * GIB}\n", "", 4 * GIB),  # no meminfo
        (None, None, "", None),  # nothing known
    ],
)
def test_usable_memory(
    memory_max_v2: str | None, limit_v1: str | None, meminfo: str, expected: int | None
) -> None:
    limit = machine.cgroup_memory_limit(memory_max_v2, limit_v1)
    assert machine.usable_memory(limit, machine.mem_available(meminfo)) == expected


@pytest.mark.parametrize(
    ("usable_gib", "weights_gib", "demand_gib", "expected_gib"),
    [
        (20, 2, 4, 4),  # room to spare: only what max_num_seqs x max_model_len can fill
        # 0.9 x 8 - 2 weights - (1 + 0.05 x 2) overhead = 4.1 GiB < 16 GiB of demand
        (8, 2, 16, 0.9 * 8 - 2 - 1.1),
        (2, 2, 4, 0),  # the weights alone fill it: nothing left (the engine then refuses)
    ],
)
def test_host_kv_budget(
    usable_gib: float, weights_gib: float, demand_gib: float, expected_gib: float
) -> None:
    budget = memory.host_kv_budget_bytes(usable_gib * GIB, 0.9, weights_gib * GIB, demand_gib * GIB)
    assert budget == pytest.approx(expected_gib * GIB)


@pytest.mark.parametrize(
    ("requested_gib", "capacity_gib", "weights_gib", "refused"),
    [
        (4, 20, 2, False),
        (18, 20, 2, False),  # exactly what is left beside the weights: the user's call
        (18.5, 20, 2, True),
        (1, 2, 2, True),  # the weights alone fill it
        (850_000, 22.4, 0.01, True),  # a petabyte typed as bytes
    ],
)
def test_a_kv_cache_memory_that_cannot_fit_beside_the_weights_is_refused(
    requested_gib: float, capacity_gib: float, weights_gib: float, refused: bool
) -> None:
    error = memory.kv_cache_memory_error(
        requested_gib * GIB, capacity_gib * GIB, weights_gib * GIB, "GPU cuda:0 memory"
    )
    if not refused:
        assert error is None
        return
    assert error is not None
    room = max(capacity_gib - weights_gib, 0)
    assert error.startswith(f"--kv-cache-memory {requested_gib:.2f} GiB cannot fit: GPU cuda:0")
    assert f"pass at most {room:.2f} GiB ({int(room * GIB)} bytes)" in error


CPU, GPU = torch.device("cpu"), torch.device("cuda:0")
# 2 layers x 2 KV heads x 64 x 2 (K and V) x 2 bytes: 1 KiB per token, 16 KiB per block.
SMALL = memory.ModelFacts(parameters=1_000_000, layers=2, kv_heads=2, head_dim=64)
HALF_DRAFT = memory.ModelFacts(parameters=1_000_000, layers=1, kv_heads=2, head_dim=64)
MIB = 2**20


def room(
    device: torch.device, gpu_gib: float | None, usable_gib: float | None, weights_gib: float
) -> sizing.MemoryRoom:
    def to_bytes(gib: float | None) -> int | None:
        return None if gib is None else int(gib * GIB)

    return sizing.MemoryRoom(
        device, to_bytes(gpu_gib), to_bytes(usable_gib), int(weights_gib * GIB)
    )


@pytest.mark.parametrize(
    ("kv_cache_memory_gib", "memory_room", "demand_gib", "expected_gib", "source"),
    [
        (4, room(CPU, None, 20, 2), 1, 4, "--kv-cache-memory"),
        (4, room(CPU, None, None, 2), 1, 4, "--kv-cache-memory"),  # nothing to check it against
        # 0.9 x 80 - 14 weights - (1 + 0.05 x 14) overhead
        (None, room(GPU, 80, None, 14), 1, 0.9 * 80 - 14 - 1.7, "0.9 of 80.0 GiB GPU memory"),
        (None, room(CPU, None, 20, 2), 4, 4, "max_num_seqs x max_model_len, under 0.9 of 20.0"),
        (None, room(CPU, None, 8, 2), 16, 0.9 * 8 - 2 - 1.1, "of 8.0 GiB usable memory, less"),
    ],
)
def test_kv_budget(
    kv_cache_memory_gib: float | None,
    memory_room: sizing.MemoryRoom,
    demand_gib: float,
    expected_gib: float,
    source: str,
) -> None:
    kv_cache_memory = None if kv_cache_memory_gib is None else int(kv_cache_memory_gib * GIB)
    config = EngineConfig(model="m", kv_cache_memory=kv_cache_memory)
    budget = sizing.kv_budget(config, memory_room, int(demand_gib * GIB))
    assert budget.bytes == pytest.approx(expected_gib * GIB)
    assert source in budget.source


@pytest.mark.parametrize(
    ("kv_cache_memory_gib", "memory_room", "message"),
    [
        (None, room(CPU, None, None, 2), "cannot tell how much memory this process may use"),
        (30, room(GPU, 24, None, 2), "--kv-cache-memory 30.00 GiB cannot fit: GPU cuda:0 memory"),
        (30, room(CPU, None, 16, 2), "cannot fit: the memory this process may use is 16.00 GiB"),
    ],
)
def test_a_kv_budget_that_cannot_be_had_is_refused(
    kv_cache_memory_gib: float | None, memory_room: sizing.MemoryRoom, message: str
) -> None:
    kv_cache_memory = None if kv_cache_memory_gib is None else int(kv_cache_memory_gib * GIB)
    config = EngineConfig(model="m", kv_cache_memory=kv_cache_memory)
    with pytest.raises(ValueError, match=message):
        sizing.kv_budget(config, memory_room, GIB)


@pytest.mark.parametrize(
    ("kv_cache_memory", "draft", "expected_blocks", "source"),
    [
        (MIB, None, 64, "--kv-cache-memory"),  # 1 MiB of 16 KiB blocks
        (MIB, HALF_DRAFT, 42, "--kv-cache-memory"),  # each block costs 1.5 times as much
        # On a host: what 4 sequences of 256 tokens fill (4 x 16 blocks), a draft's share too.
        (None, None, 64, "max_num_seqs x max_model_len"),
        (None, HALF_DRAFT, 64, "max_num_seqs x max_model_len"),
    ],
)
def test_size_kv_pool(
    kv_cache_memory: int | None,
    draft: memory.ModelFacts | None,
    expected_blocks: int,
    source: str,
) -> None:
    config = EngineConfig(model="m", kv_cache_memory=kv_cache_memory, max_num_seqs=4)
    pool = sizing.size_kv_pool(config, room(CPU, None, 20, 1), 256, SMALL, draft, 2)
    assert pool.num_blocks == expected_blocks
    assert pool.budget.source.startswith(source)


def test_a_pool_that_cannot_hold_one_sequence_is_refused() -> None:
    config = EngineConfig(model="m", kv_cache_memory=128 * 1024)  # 8 blocks of 16 KiB
    with pytest.raises(
        ValueError, match="holds 8 blocks; one sequence of max_model_len 256 needs 16"
    ):
        sizing.size_kv_pool(config, room(CPU, None, 20, 1), 256, SMALL, None, 2)
