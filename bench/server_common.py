"""A real `kvpilot-runtime serve` process for the server benchmarks: started, awaited until
/ready, stopped with SIGTERM (its drain) when the block ends; and the split of the machine's
cores between a replica and what stands in front of it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


@contextmanager
def runtime_server(
    model: Path, port: int, *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[str, int]]:
    """(base URL, pid) of a server of `model` (served as `tiny`) on 127.0.0.1:`port`."""
    command = [sys.executable, "-m", "kvpilot.runtime.cli", "serve", "--model", str(model),
               "--served-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", *args]  # fmt: skip
    process = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not is_ready(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("runtime server did not become ready")
            time.sleep(0.2)
        yield url, process.pid
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)


def is_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass(frozen=True)
class Cores:
    """Where a gateway benchmark's processes run: the replica and the client on some cores, the
    gateway (and its store) on the others, as on a cluster where the gateway's pod has CPUs of
    its own. On shared cores every cycle the gateway spends would be taken from the replica's
    forward pass or from the client, which slows only the requests sent through the gateway: a
    gateway-vs-direct figure would measure the machine, not the proxy. The client shares the
    replica's cores in both arms alike."""

    replica: set[int]
    gateway: set[int]

    @property
    def words(self) -> str:
        if self.replica == self.gateway:
            return "one core for everything"
        return (f"the replica and the client on core(s) {sorted(self.replica)}, the gateway on "
                f"{sorted(self.gateway)}")  # fmt: skip


def split_cores() -> Cores:
    """The first core for the replica and the client, the others for the gateway (all of one
    where there is one)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return Cores(set(cpus), set(cpus))
    return Cores({cpus[0]}, set(cpus[1:]))


@contextmanager
def pinned(pid: int, cpus: set[int]) -> Iterator[None]:
    """Every thread of `pid` on `cpus` (threads and processes it starts later inherit that),
    then back to where it was."""
    before = os.sched_getaffinity(pid)
    set_affinity(pid, cpus)
    try:
        yield
    finally:
        set_affinity(pid, before)


def set_affinity(pid: int, cpus: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended since the listing
            os.sched_setaffinity(int(tid), cpus)
