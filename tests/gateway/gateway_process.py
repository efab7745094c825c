"""Real processes for the gateway tests: `kvpilot-runtime serve` replicas of tiny-llama (started
together, awaited with a generous deadline: a shared CI machine can take minutes to load torch in
several processes at once) and a `kvpilot-gateway` on a static config."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.server.server_process import MODEL, TINY, free_port, wait_for

STARTUP_TIMEOUT_S = 600.0


class Replica:
    """A `kvpilot-runtime serve` process; `wait_ready()` before use."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "kvpilot.runtime.cli", "serve", "--model", str(TINY),
                   "--served-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
                   "--log-level", "warning", *args]  # fmt: skip
        self.log_path = log_path
        self.log = log_path.open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> None:
        wait_for(self.is_ready, STARTUP_TIMEOUT_S, f"replica ready (log: {self.log_path})")

    def is_ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"replica exited: {self.log_path.read_text()[-3000:]}")
        try:
            return httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> dict[str, float]:
        """Every sample as `name` or `name{label=value,...}` (model_name left out) -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k != "model_name")  # fmt: skip
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return int(self.process.returncode)


def start_replicas(count: int, args: list[str], workdir: Path) -> list[Replica]:
    """`count` replicas started at once and awaited; all stopped if one fails to start."""
    replicas = [Replica(args, workdir / f"replica{i}.log") for i in range(count)]
    try:
        for replica in replicas:
            replica.wait_ready()
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas


class GatewayProcess:
    def __init__(self, config: dict[str, Any], workdir: Path, *flags: str, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config_path = workdir / "gateway.yaml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "gateway.log"
        self.log = self.log_path.open("w")
        command = [sys.executable, "-m", "kvpilot.gateway.cli", "--config", str(config_path),
                   "--host", "127.0.0.1", "--port", str(self.port), *flags]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )
        wait_for(self.is_ready, 60, f"gateway ready (log: {self.log_path})")

    def is_ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"gateway exited: {self.log_path.read_text()[-3000:]}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    def log_lines(self) -> list[str]:
        return self.log_path.read_text().splitlines()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return int(self.process.returncode)
