"""bench.cold_start's CPU reading: a process's user + system seconds from /proc/<pid>/stat, and
the same reading of a real process that has burned some CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.cold_start import cpu_seconds, process_cpu_seconds


def stat_line(name: str, utime: int, stime: int) -> str:
    """/proc/<pid>/stat: pid (comm) state, fields 4..13, then utime (14) and stime (15)."""
    return f"4242 ({name}) S " + " ".join(["7"] * 10) + f" {utime} {stime} 1 2 20 0 3\n"


@pytest.mark.parametrize(
    ("name", "utime", "stime", "seconds"),
    [
        ("python", 250, 30, 2.8),
        ("kvpilot-runtime", 0, 0, 0.0),
        ("odd) (name", 100, 100, 2.0),  # a name with spaces and a parenthesis
    ],
)
def test_cpu_seconds(name: str, utime: int, stime: int, seconds: float) -> None:
    assert cpu_seconds(stat_line(name, utime, stime), 100) == pytest.approx(seconds)


# Burns 0.3 s of CPU, says so, then waits (idle) until its stdin closes.
BUSY = """
import sys, time
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
print("done", flush=True)
sys.stdin.read()
"""


def test_a_busy_process_has_used_its_cpu() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", BUSY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "done\n"
        used = process_cpu_seconds(process.pid)
    finally:
        process.communicate("")
    assert 0.3 <= used < 30  # at least what it burned; the interpreter's start adds a little
