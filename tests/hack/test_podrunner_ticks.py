"""The pod runner's tick timing (hack/podrunner/runner.py): it polls every POLL_S, and wakes
sooner when a pod's readiness probe falls due before the next poll, or a container's process
exits; probes keep their own period's ticks and run before the tick's lists."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from hack.podrunner.runner import LocalPod, PodRunner, next_probe_at, until_next_tick


@pytest.mark.parametrize(
    ("now", "probes_due", "seconds"),
    [
        (10.0, [], 0.5),  # no pods: the poll
        (10.0, [10.2], 0.2),  # a probe before the poll: at it
        (10.0, [10.9, 10.2, 13.0], 0.2),  # the first of several
        (10.0, [12.0], 0.5),  # a probe after the poll (a ready pod's 10 s period)
        (10.0, [0.0], 0.5),  # never probed yet (init containers) or already due: the poll
        (10.0, [10.0], 0.5),  # due now: this tick probes it
    ],
)
def test_until_next_tick(now: float, probes_due: list[float], seconds: float) -> None:
    assert until_next_tick(now, probes_due, poll_s=0.5) == pytest.approx(seconds)


def test_a_container_process_exit_wakes_the_loop(tmp_path: Path) -> None:
    runner = PodRunner(client.ApiClient(), tmp_path / "logs", [])  # no API call is made
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    runner.wake_on_exit(proc)
    assert not runner.wake.wait(0.2)  # still running: the loop waits for its poll
    assert proc.stdin is not None
    proc.stdin.close()  # the process reads EOF and exits
    assert runner.wake.wait(30)
    assert proc.poll() == 0  # the waiting thread reaped it; the tick reads its exit code


@pytest.mark.parametrize(
    ("due", "now", "period", "expected"),
    [
        (0.0, 5.3, 1.0, 6.3),  # never run: a period after this first run
        (10.0, 10.0, 1.0, 11.0),  # on time
        (10.0, 10.3, 1.0, 11.0),  # late (the tick's own work): the next tick is not pushed back
        (10.0, 11.0, 1.0, 12.0),  # a whole period late: that tick is gone, the next one
        (10.0, 12.7, 1.0, 13.0),  # ticks missed are dropped, never run in a burst
        (10.0, 10.5, 2.0, 12.0),  # a ready pod's readiness period
        (10.0, 9.5, 1.0, 11.0),  # run before it was due (a clock read first): still after now
    ],
)
def test_next_probe_at(due: float, now: float, period: float, expected: float) -> None:
    assert next_probe_at(due, now, period) == pytest.approx(expected)


class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def ready_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def probed_pod(port: int) -> dict[str, Any]:
    probe = {"httpGet": {"path": "/ready", "port": port}, "periodSeconds": 2}
    container = {"name": "app", "readinessProbe": probe}
    return {"metadata": {"name": "p"}, "spec": {"containers": [container]}, "status": {}}


@pytest.mark.parametrize(
    ("due_in_s", "probed"),
    [(-0.01, True), (30.0, False), (None, False)],
    ids=["due", "not-yet-due", "never-probed"],  # the first probe is the tick's, after the start
)
def test_a_due_probe_runs_on_the_pod_as_last_read(
    tmp_path: Path,
    ready_port: int,
    due_in_s: float | None,
    probed: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = PodRunner(client.ApiClient(), tmp_path / "logs", [])
    reported: list[dict[str, Any]] = []  # the status writes, kept here instead of the API's
    monkeypatch.setattr(runner, "report", lambda _pod, _local, status: reported.append(status))
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                          stdin=subprocess.PIPE) as proc:  # fmt: skip
        due = 0.0 if due_in_s is None else time.monotonic() + due_in_s
        local = LocalPod("ns", "p", "127.0.0.1", proc=proc, next_probe=due)
        local.last_read = probed_pod(ready_port)
        runner.pods["uid"] = local
        runner.probe_due()
        assert proc.stdin is not None
        proc.stdin.close()
    assert local.ready is probed
    assert [s["conditions"][-1]["status"] for s in reported] == (["True"] if probed else [])
    if probed:  # its next run on the period's ticks, 1 s while it was not ready
        assert local.next_probe == pytest.approx(due + 1.0)
