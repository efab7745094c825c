"""The runtime's start-up phases, read from a real server: in order, adding up to the start
the test itself observes (from before the process was created to the first /ready 200)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from kvpilot.contract.metric_names import STARTUP_PHASE_SECONDS, STARTUP_PHASES
from tests.support.server_process import STARTUP_TIMEOUT_S, RuntimeServer, wait_for

pytestmark = pytest.mark.slow  # starts a runtime process

TICK_S = 0.01  # /proc/self/stat counts the process's creation in clock ticks (USER_HZ 100)


class ReadyWatch:
    """Polls /ready, keeping when the last 503 was sent and when the first 200 came back."""

    def __init__(self, server: RuntimeServer) -> None:
        self.server = server
        self.last_not_ready_sent = 0.0
        self.first_ready_received = 0.0

    def is_ready(self) -> bool:
        sent = time.time()
        try:
            status = httpx.get(f"{self.server.url}/ready", timeout=2).status_code
        except httpx.HTTPError:
            return False
        if status == 200:
            self.first_ready_received = time.time()
            return True
        self.last_not_ready_sent = sent
        return False


def test_the_phases_are_ordered_and_add_up_to_the_observed_start(tmp_path: Path) -> None:
    before_start = time.time()
    server = RuntimeServer(["--max-model-len", "256"], tmp_path / "server.log", wait=False)
    try:
        watch = ReadyWatch(server)
        wait_for(watch.is_ready, STARTUP_TIMEOUT_S, f"server ready (log: {server.log_path})")
        startup = httpx.get(f"{server.url}/version").json()["startup"]
        metrics = server.metrics()
    finally:
        assert server.stop() == 0
    phases = startup["phases"]
    assert list(phases) == list(STARTUP_PHASES)
    assert all(seconds >= 0 for seconds in phases.values()), phases
    assert phases["imports"] > 0  # torch alone takes seconds
    assert before_start - TICK_S <= startup["started_at"] <= watch.first_ready_received
    # /ready answered 503 before the server marked itself serving, and 200 after
    ready_at = startup["started_at"] + sum(phases.values())
    assert watch.last_not_ready_sent - TICK_S <= ready_at <= watch.first_ready_received + TICK_S
    exposed = {
        phase: metrics[f"{STARTUP_PHASE_SECONDS}{[('phase', phase)]}"] for phase in STARTUP_PHASES
    }
    assert exposed == pytest.approx(phases)
