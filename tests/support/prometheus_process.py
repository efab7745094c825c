"""A real Prometheus (Debian's binary) on a free port of 127.0.0.1 with a given config, for the
operator's tests that read runtime metrics through PromQL."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client import start_http_server

from kvpilot.runtime.engine.stats import EngineStats
from kvpilot.runtime.server.metrics import ServerMetrics
from tests.support.kube import wait_until
from tests.support.server_process import free_port

HAS_PROMETHEUS = shutil.which("prometheus") is not None


def scrape_config(targets: dict[str, tuple[int, dict[str, str]]]) -> dict[str, Any]:
    """Every target (name -> port, labels) scraped each second, with the labels kubernetes_sd
    relabelling would give the pod."""
    static = [
        {"targets": [f"127.0.0.1:{port}"], "labels": labels} for port, labels in targets.values()
    ]
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "kvpilot-pods", "static_configs": static}],
    }


@contextlib.contextmanager
def running_prometheus(settings: dict[str, Any], workdir: Path) -> Iterator[str]:
    """Prometheus with `settings` as its config; its base URL once /-/ready answers."""
    with started_prometheus(settings, workdir) as (url, _process):
        yield url


@contextlib.contextmanager
def started_prometheus(
    settings: dict[str, Any], workdir: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """As running_prometheus, with the process too, for a test that stops it midway."""
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(settings))
    log = workdir / "prometheus.log"
    port = free_port()
    with log.open("w") as errors:
        process = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=errors,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"prometheus exited: {log.read_text()}")
        try:
            return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, timeout_s=30, what="prometheus ready")
        yield url, process
    finally:
        process.terminate()
        process.wait(timeout=30)


def runtime_exporter(
    model: str, stats: EngineStats
) -> tuple[int, ServerMetrics, Callable[[], None]]:
    """The runtime's own metrics module served on a free port of 127.0.0.1, as a pod exports
    it: (port, its metrics, stop)."""
    runtime = ServerMetrics(model, lambda: stats)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=runtime.registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return port, runtime, stop
