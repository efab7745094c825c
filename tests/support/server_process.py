"""A real `kvpilot-runtime serve` process on the tiny model, for the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import terminate

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-llama"
MODEL = "tiny"
# A bound, not a wait: a ready server answers at once; on a shared 2-core machine under load
# importing torch alone has taken 30 s and a start over 120 s.
STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)  # polling interval for a condition with a deadline
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


class RuntimeServer:
    """Started and awaited until /ready; `wait=False` only starts it (several replicas load
    together, then each is awaited with `wait_ready`)."""

    def __init__(self, args: list[str], log_path: Path, wait: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "kvpilot.runtime.cli", "serve", "--model", str(TINY),
                   "--served-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
                   "--log-level", "warning", *args]  # fmt: skip
        self.log_path = log_path
        self.log = log_path.open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait_ready(STARTUP_TIMEOUT_S)

    def wait_ready(self, timeout_s: float) -> None:
        try:
            wait_for(self.is_ready, timeout_s, f"server ready (log: {self.log_path})")
        except BaseException:  # no fixture will stop a server that never became ready
            self.process.kill()
            self.process.wait()
            self.log.close()
            raise

    def is_ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"server exited: {self.log_path.read_text()[-3000:]}")
        try:
            return httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> dict[str, float]:
        """Every sample as `name{sorted labels}` -> value (and bare `name` for the model label)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "model_name"}
                key = s.name + (str(sorted(labels.items())) if labels else "")
                samples[key] = s.value
        return samples

    def stop(self) -> int:
        code = terminate(self.process, 60)
        self.log.close()
        return code
