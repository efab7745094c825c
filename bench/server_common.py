"""A real `kvpilot-runtime serve` process for the server benchmarks: started, awaited until
/ready, stopped with SIGTERM (its drain) when the block ends."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
