"""Real processes for the gateway tests: `kvpilot-runtime serve` replicas of tiny-llama (the server
tests' RuntimeServer, started together and awaited with a generous deadline: a shared CI machine
can take minutes to load torch in several processes at once) and a `kvpilot-gateway` on a static
config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import terminate
from tests.support.server_process import RuntimeServer, free_port, wait_for

STARTUP_TIMEOUT_S = 600.0


def start_replicas(count: int, args: list[str], workdir: Path) -> list[RuntimeServer]:
    """`count` replicas started at once and awaited; all stopped if one fails to start."""
    return start_servers([args] * count, workdir)


def start_servers(arg_lists: list[list[str]], workdir: Path) -> list[RuntimeServer]:
    """One replica per argument list, started at once and awaited; all stopped if one fails."""
    replicas = [RuntimeServer(args, workdir / f"replica{i}.log", wait=False)
                for i, args in enumerate(arg_lists)]  # fmt: skip
    try:
        for replica in replicas:
            replica.wait_ready(STARTUP_TIMEOUT_S)
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
        code = terminate(self.process, 30)
        self.log.close()
        return code
