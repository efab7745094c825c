"""The runtime's start-up, phase by phase (contract.metric_names.STARTUP_PHASES): each phase is
marked as it ends, from whichever thread ran it, and read as the seconds it added to the start.

Phases may overlap (the model's location with the imports): a phase is counted from the later of
its own end and the previous phase's end, so each figure is the time that phase kept the start
waiting, and the figures add up to the start itself, from the process's creation (which the
kernel records, before Python runs) to /ready.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from kvpilot.contract.metric_names import STARTUP_PHASES


def critical_path(started_at: float, marks: Mapping[str, float]) -> dict[str, float]:
    """Seconds each phase added, in order, up to the first phase not yet marked."""
    seconds: dict[str, float] = {}
    end = started_at
    for phase in STARTUP_PHASES:
        if phase not in marks:
            break
        at = max(end, marks[phase])
        seconds[phase], end = at - end, at
    return seconds


def process_age(proc_self_stat: str, boot_seconds: float, ticks_per_s: int) -> float:
    """Seconds since this process was created, from /proc/self/stat's starttime (field 22, clock
    ticks after boot) and the seconds since boot now. The command name (field 2) may hold spaces
    and parentheses, so fields are counted from its closing parenthesis (field 3 onwards)."""
    after_name = proc_self_stat[proc_self_stat.rindex(")") + 2 :].split()
    start_ticks = int(after_name[22 - 3])
    return max(0.0, boot_seconds - start_ticks / ticks_per_s)


def describe(seconds: Mapping[str, float]) -> str:
    """The start-up log line's figures: `8.9 s: interpreter 0.1 s, imports 6.9 s, ...`."""
    parts = ", ".join(f"{phase} {value:.2f} s" for phase, value in seconds.items())
    return f"{sum(seconds.values()):.2f} s: {parts}"


class StartupClock:
    """The phases' ends as they are marked (any thread: one dict write each)."""

    def __init__(self, started_at: float, now: Callable[[], float] = time.time) -> None:
        self.started_at = started_at  # unix seconds
        self.now = now
        self.marks: dict[str, float] = {}

    @classmethod
    def of_this_process(cls) -> StartupClock:
        """Started when the kernel created this process (Linux); elsewhere, now."""
        try:
            with open("/proc/self/stat") as stat:
                age = process_age(
                    stat.read(),
                    time.clock_gettime(time.CLOCK_BOOTTIME),
                    os.sysconf("SC_CLK_TCK"),
                )
        except (OSError, ValueError, AttributeError):
            age = 0.0
        return cls(time.time() - age)

    def mark(self, phase: str) -> None:
        if phase not in STARTUP_PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; phases: {STARTUP_PHASES}")
        self.marks.setdefault(phase, self.now())  # a phase ends once

    def seconds(self) -> dict[str, float]:
        return critical_path(self.started_at, self.marks)


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while the server's modules are imported, then what they
    made frozen (gc.freeze: kept out of every later collection) and the collector back on.

    Imports make hundreds of thousands of objects that live as long as the process (torch's
    modules, classes and functions) and almost no garbage; the collector, run every 700 new
    container objects, traversed that growing heap about 530 times during the server's imports
    and freed 257 objects: 0.4-0.5 s of a 2.5 s import on this machine (docs/benchmarks.md, cold
    start). Frozen, they are not traversed again by the full collections made while serving, nor
    by the interpreter's at exit: an idle server's SIGTERM -> exit went from 1.9 s to 0.8 s at a
    load of 11 on 2 cores, and a replacement pod waits for that exit to get the old pod's GPU."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
