"""Processes the dev cluster starts are stopped by `down`, scripts (interpreter + path) included."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hack.devcluster import procs


def test_a_script_started_by_path_is_recognised_and_stopped(tmp_path: Path) -> None:
    script = tmp_path / "sleeper"
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    script.chmod(0o755)
    proc = procs.start("sleeper", [str(script)], tmp_path / "run", tmp_path / "logs")
    assert procs.is_running(tmp_path / "run", "sleeper")
    procs.stop(tmp_path / "run", "sleeper", grace_s=5)
    assert proc.wait(timeout=5) is not None
    assert not procs.is_running(tmp_path / "run", "sleeper")


def test_a_pid_running_another_program_is_not_ours() -> None:
    # This test's own pid runs the Python interpreter, not the binary a pid file would name.
    assert not procs.pid_runs(os.getpid(), "/nonexistent/kube-apiserver")


def test_free_ports_are_distinct_and_free() -> None:
    """Each socket stays bound until all are picked, so the kernel never hands one out twice."""
    ports = procs.free_ports(64)
    assert len(set(ports)) == 64
    for port in ports:
        procs.require_port_free(port, "the test")


def test_free_ports_skip_the_ports_already_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The S3 gateway's own port is passed as taken when SeaweedFS's internal ports are picked:
    a pick that equals it is dropped (here the kernel's picks are scripted)."""
    picks = iter([4100, 4101, 4100, 4102, 4103])

    class ScriptedSocket:
        def __enter__(self) -> ScriptedSocket:
            self.port = next(picks)
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def bind(self, address: tuple[str, int]) -> None:
            assert address == ("127.0.0.1", 0)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(procs.socket, "socket", ScriptedSocket)
    assert procs.free_ports(3, taken={4100}) == [4101, 4102, 4103]
