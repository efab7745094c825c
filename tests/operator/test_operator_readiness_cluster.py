"""The operator's /readyz on a real control plane: 200 once kopf has started it and the autoscaler
Lease's holder is known; before that, 503 saying what is missing."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.operator_cluster import Operator, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_readyz_turns_ready_once_started_and_the_lease_is_known(
    cluster: Any, crds: None, tmp_path: Path
) -> None:
    port = free_port()
    operator = Operator(cluster, tmp_path / "operator.log", f"--metrics-port={port}")
    answers: list[tuple[int, str]] = []

    def ready() -> bool:
        response = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
        answers.append((response.status_code, response.text))
        return response.status_code == 200

    operator.start()
    try:
        wait_for(ready, "/readyz 200", operator, timeout=60)
    finally:
        operator.stop()
    assert answers[-1] == (200, "ready\n")
    # Whatever came before was a 503 naming what was missing, never an unexplained failure.
    assert all(code == 503 and text.startswith("not ready: ") for code, text in answers[:-1])
