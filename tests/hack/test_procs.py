"""Processes the dev cluster starts are stopped by `down`, scripts (interpreter + path) included."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
