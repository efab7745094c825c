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


class LowestFreePortKernel:
    """A kernel that gives bind(("127.0.0.1", 0)) the lowest port no open socket holds, so a
    port picked and closed is handed out again: what happened to SeaweedFS's S3 port."""

    def __init__(self, first: int) -> None:
        self.first, self.bound = first, set[int]()

    def socket(self) -> LowestFreePortKernel.Socket:
        return LowestFreePortKernel.Socket(self)

    class Socket:
        def __init__(self, kernel: LowestFreePortKernel) -> None:
            self.kernel, self.port = kernel, 0

        def __enter__(self) -> LowestFreePortKernel.Socket:
            return self

        def __exit__(self, *exc: object) -> None:
            self.kernel.bound.discard(self.port)

        def bind(self, address: tuple[str, int]) -> None:
            assert address == ("127.0.0.1", 0)
            self.port = min(
                set(range(self.kernel.first, self.kernel.first + 100)) - self.kernel.bound
            )
            self.kernel.bound.add(self.port)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)


def test_free_ports_hold_each_pick_and_skip_the_ports_already_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Picked one at a time and closed, every pick would be 4100 on this kernel; held, they are
    distinct, and the S3 gateway's own port, passed as taken, is never one of SeaweedFS's
    internal ports. Nothing stays bound afterwards."""
    kernel = LowestFreePortKernel(4100)
    monkeypatch.setattr(procs.socket, "socket", kernel.socket)
    assert procs.free_ports(3) == [4100, 4101, 4102]
    assert procs.free_ports(3, taken={4100}) == [4101, 4102, 4103]
    assert procs.free_port() == 4100 and kernel.bound == set()
