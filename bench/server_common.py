"""The benchmarks' server processes (`kvpilot-runtime serve`, `kvpilot-gateway`, Redis; and
llama-server through bench.llama_cpp_common): each started, awaited until it answers, stopped
with SIGTERM (the runtime's and the gateway's drain) when its block ends; and the split of the
machine's cores between a replica and what stands in front of it."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import redis
import yaml

from hack.devcluster.procs import free_port, http_ok


@contextmanager
def serving(
    argv: list[str],
    is_up: Callable[[], bool],
    what: str,
    *,
    start_s: float,
    stop_s: float = 30.0,
    **popen: Any,
) -> Iterator[subprocess.Popen[bytes]]:
    """`argv` started (`popen`: subprocess.Popen's keywords), polled with `is_up` until it
    answers, and stopped with SIGTERM when the block ends, however it ends."""
    process = subprocess.Popen(argv, **popen)
    try:
        deadline = time.monotonic() + start_s
        while not is_up():
            if process.poll() is not None:
                raise RuntimeError(
                    f"{what} exited with status {process.returncode} before it answered: "
                    f"{shlex.join(argv)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer within {start_s:.0f} s: "
                                   f"{shlex.join(argv)}")  # fmt: skip
            time.sleep(0.1)  # polling a starting process, with a deadline
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=stop_s)


@contextmanager
def runtime_server(
    model: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[str, int]]:
    """(base URL, pid) of a server of `model` (served as `tiny`) on a free port of 127.0.0.1,
    once it is /ready (its model loaded)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "kvpilot.runtime.cli", "serve", "--model", str(model),
            "--served-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", *args]  # fmt: skip
    ready = f"{url}/ready"
    with serving(argv, partial(http_ok, ready), "kvpilot-runtime serve", start_s=300, stop_s=120,
                 env=env) as process:  # fmt: skip
        yield url, process.pid


@contextmanager
def gateway_server(
    config: dict[str, Any], workdir: Path, *flags: str, log: Path | None = None
) -> Iterator[str]:
    """The base URL of a `kvpilot-gateway` process with `config` (its YAML written under
    `workdir`) and CLI `flags` (logging at warning unless they say otherwise: the last
    --log-level counts), once /health answers; its output to `log` when one is named."""
    port = free_port()
    path = workdir / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "kvpilot.gateway.cli", "--config", str(path), "--host",
            "127.0.0.1", "--port", str(port), "--log-level", "warning", *flags]  # fmt: skip
    health = f"{url}/health"
    with contextlib.ExitStack() as stack:
        output: dict[str, Any] = {}
        if log is not None:
            output = {"stdout": stack.enter_context(log.open("w")), "stderr": subprocess.STDOUT}
        stack.enter_context(
            serving(argv, partial(http_ok, health), "kvpilot-gateway", start_s=60, **output)
        )
        yield url


@contextmanager
def redis_server(workdir: Path, *args: str) -> Iterator[str]:
    """The URL of a `redis-server` on a free port of 127.0.0.1 (`args`: more of its options), its
    files and log under `workdir`, once it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: run hack/system-deps.sh")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save",
            "", "--logfile", str(workdir / f"redis-{port}.log"), *args]  # fmt: skip
    with serving(argv, partial(answers_ping, url), "redis-server", start_s=30):
        yield url


def answers_ping(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
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
