"""`kvpilot-runtime serve --tensor-parallel-size 2` as a real process: it answers, and SIGTERM
leaves no worker process behind."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.processes import child_pids, cmdline, is_gone
from tests.support.server_process import MODEL, RuntimeServer, wait_for

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model


def test_tp2_server_completes_and_sigterm_leaves_no_worker(tmp_path: Path) -> None:
    server = RuntimeServer(
        ["--device", "cpu", "--tensor-parallel-size", "2", "--max-model-len", "256",
         "--kv-cache-memory", str(4 * 2**20)],
        tmp_path / "server.log",
    )  # fmt: skip
    try:
        children = child_pids(server.process.pid)
        workers = [pid for pid in children if "spawn_main" in cmdline(pid)]
        assert len(workers) == 1, f"expected one worker among {children}"
        body = {"model": MODEL, "prompt": "The", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 4
    finally:
        code = server.stop()  # SIGTERM: drain, close the engine, exit
    assert code == 0, (tmp_path / "server.log").read_text()[-3000:]
    wait_for(lambda: all(is_gone(pid) for pid in children), 30, f"children {children} exit")
