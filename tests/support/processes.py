"""Process checks without psutil: Linux /proc, for tests that must leave no process behind."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path


def is_gone(pid: int) -> bool:
    """No such process, or one that has exited and only waits for a reaper (a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def child_pids(parent_pid: int) -> list[int]:
    """The live children of a process (any thread of it may have started them)."""
    children = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited while we looked
        if int(fields[1]) == parent_pid and fields[0] not in ("Z", "X"):
            children.append(int(stat_path.parent.name))
    return children


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def terminate(process: subprocess.Popen[bytes] | subprocess.Popen[str], timeout_s: float) -> int:
    """SIGTERM (the process drains and exits on its own), SIGKILL after `timeout_s`; its exit
    code once reaped."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return int(process.returncode)
