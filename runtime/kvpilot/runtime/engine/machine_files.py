"""The reads behind engine/machine.py: the /proc and /sys files it decides from (None where absent,
as off Linux or outside a cgroup), nothing decided here."""

from __future__ import annotations

import os
from pathlib import Path

from kvpilot.runtime.engine import machine

CGROUP = Path("/sys/fs/cgroup")


def read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def affinity_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_quota() -> float | None:
    return machine.cgroup_cpu_quota(
        read_text(CGROUP / "cpu.max"),
        read_text(CGROUP / "cpu" / "cpu.cfs_quota_us"),
        read_text(CGROUP / "cpu" / "cpu.cfs_period_us"),
    )


def thread_choice(requested: int | None) -> machine.ThreadChoice:
    """Raises ValueError for --threads above the cores available."""
    return machine.choose_threads(
        requested, os.environ.get("OMP_NUM_THREADS"), cpu_quota(), affinity_cores()
    )


def cpu_flags() -> frozenset[str]:
    return machine.cpu_flags(read_text(Path("/proc/cpuinfo")) or "")


def cpu_supports_bf16() -> bool:
    return machine.cpu_supports_bf16(cpu_flags())


def cpu_supports_int8_dot() -> bool:
    return machine.cpu_supports_int8_dot(cpu_flags())


def usable_memory() -> int | None:
    limit = machine.cgroup_memory_limit(
        read_text(CGROUP / "memory.max"), read_text(CGROUP / "memory" / "memory.limit_in_bytes")
    )
    available = machine.mem_available(read_text(Path("/proc/meminfo")) or "")
    return machine.usable_memory(limit, available)
