"""kind-based tests run only where a Docker engine answers; elsewhere they skip with the reason."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def docker_works() -> tuple[bool, str]:
    if shutil.which("docker") is None:
        return False, "no docker CLI on PATH"
    try:
        done = subprocess.run(
            ["docker", "info"], capture_output=True, text=True, timeout=20, check=False
        )
    except subprocess.TimeoutExpired:
        return False, "`docker info` timed out"
    if done.returncode != 0:
        return False, "`docker info` failed: no Docker engine (kind needs one)"
    return True, ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    works, reason = docker_works()
    if works:
        return
    for item in items:
        if "kind" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"kind tests skipped: {reason}"))
