"""The pod runner's tick timing (hack/podrunner/runner.py): it polls every POLL_S, and wakes
sooner when a pod's readiness probe falls due before the next poll, or a container's process
exits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kubernetes import client

from hack.podrunner.runner import PodRunner, until_next_tick


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
