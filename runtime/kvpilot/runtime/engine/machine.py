"""What the machine lets this process use, decided from text the kernel exposes.

Pure functions: each takes the text of a /proc or /sys file (or None when it is absent) and
returns a number or a choice, so every case (cgroup v1 or v2, no limit, a fractional quota, a CPU
without bf16 units) is a row in a table-driven test. The reads live in engine/machine_files.py.

Why these sources: a pod's CPU limit is a CFS quota, not a smaller CPU count (os.cpu_count()
still says the node's cores), and its memory limit is the cgroup's, not the node's MemTotal. A
process that ignores them runs one thread on a 16-core limit, or sizes its KV pool for a node it
does not own and is OOM-killed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Flags that mean the CPU multiplies bf16 natively (AVX512-BF16 dot products, AMX tiles), so
# bf16 weights compute faster than float32 rather than being widened on every matmul.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# Flags that mean the CPU has int8 dot products (VNNI, AMX int8 tiles): an int8 x int8 matmul
# accumulating in int32 then beats a bf16 one, so int8 weights can meet int8 activations.
INT8_DOT_CPU_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
# cgroup v1 writes "no limit" as a huge page-aligned number rather than "max".
_V1_UNLIMITED_BYTES = 2**62


@dataclass(frozen=True)
class ThreadChoice:
    num_threads: int
    source: str  # e.g. "--threads", "cgroup CPU quota 1.5 cores", "CPU affinity (2 cores)"


def cgroup_cpu_quota(
    cpu_max_v2: str | None, quota_v1: str | None, period_v1: str | None
) -> float | None:
    """Cores the CFS quota allows (1.5 for `150000 100000`), or None when there is no quota.
    cgroup v2 `cpu.max` is `QUOTA PERIOD` or `max PERIOD`; v1 splits them over two files and
    writes -1 for no quota."""
    if cpu_max_v2 is not None:
        quota, _, period = cpu_max_v2.strip().partition(" ")
        return None if quota == "max" else _ratio(quota, period or "100000")
    if quota_v1 is not None and period_v1 is not None and int(quota_v1) > 0:
        return _ratio(quota_v1, period_v1)
    return None


def _ratio(quota: str, period: str) -> float:
    return int(quota) / int(period)


def available_cores(quota_cores: float | None, affinity_cores: int) -> int:
    """Whole cores this process can keep busy: the quota rounded down (a thread on a half core
    would stall the others at each parallel region's barrier), at least one, and never more
    than the CPUs it may be scheduled on."""
    if quota_cores is None:
        return max(1, affinity_cores)
    return max(1, min(affinity_cores, math.floor(quota_cores)))


def choose_threads(
    requested: int | None, omp_env: str | None, quota_cores: float | None, affinity_cores: int
) -> ThreadChoice:
    """Torch's intra-op threads: `--threads` if given, else OMP_NUM_THREADS (an explicit
    setting torch itself honours), else the cores available. More threads than cores is refused:
    they would only take turns on the same cores."""
    cores = available_cores(quota_cores, affinity_cores)
    if requested is not None:
        if not 1 <= requested <= cores:
            raise ValueError(
                f"--threads {requested}: this process may use {cores} core(s) "
                f"({_cores_source(quota_cores, affinity_cores)}); pass 1..{cores}"
            )
        return ThreadChoice(requested, "--threads")
    if omp_env is not None and omp_env.strip().isdigit() and int(omp_env) >= 1:
        return ThreadChoice(min(int(omp_env), cores), "OMP_NUM_THREADS")
    return ThreadChoice(cores, _cores_source(quota_cores, affinity_cores))


def threads_per_rank(num_threads: int, world_size: int) -> int:
    """One tensor-parallel rank's share of the threads: on CPU the ranks of one replica compute
    at the same time on the same cores, so each taking them all would put `world_size` threads
    on every core, each stalling the others at every parallel region's barrier. At least one."""
    return max(1, num_threads // world_size)


def rank_share(choice: ThreadChoice, world_size: int) -> ThreadChoice:
    """The thread choice as each rank runs it (what /version and the start-up log report)."""
    if world_size == 1:
        return choice
    per_rank = threads_per_rank(choice.num_threads, world_size)
    return ThreadChoice(per_rank, f"{choice.source}, split over {world_size} ranks")


def _cores_source(quota_cores: float | None, affinity_cores: int) -> str:
    if quota_cores is not None and math.floor(quota_cores) < affinity_cores:
        return f"cgroup CPU quota {quota_cores:g} cores"
    return f"CPU affinity ({affinity_cores} cores)"


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of /proc/cpuinfo (x86 `flags`, Arm `Features`), first CPU's line."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_supports_bf16(flags: frozenset[str]) -> bool:
    return bool(flags & BF16_CPU_FLAGS)


def cpu_supports_int8_dot(flags: frozenset[str]) -> bool:
    return bool(flags & INT8_DOT_CPU_FLAGS)


def cgroup_memory_limit(memory_max_v2: str | None, limit_v1: str | None) -> int | None:
    """The cgroup's memory limit in bytes, or None when there is none (`max`, or v1's huge
    sentinel)."""
    if memory_max_v2 is not None:
        text = memory_max_v2.strip()
        return None if text == "max" else int(text)
    if limit_v1 is not None:
        value = int(limit_v1.strip())
        return None if value >= _V1_UNLIMITED_BYTES else value
    return None


def mem_available(meminfo: str) -> int | None:
    """MemAvailable of /proc/meminfo in bytes (the kernel's estimate of what can be allocated
    without swapping), or None when absent."""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            kib = line.split()[1]
            return int(kib) * 1024
    return None


def usable_memory(limit: int | None, available: int | None) -> int | None:
    """What this process may still allocate: the cgroup limit, or what the host has available,
    whichever is smaller (a limit above the host's free memory would not be there to take)."""
    known = [value for value in (limit, available) if value is not None]
    return min(known) if known else None
