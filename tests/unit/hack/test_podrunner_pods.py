"""Pure parts of the local pod runner: pod IPs, argv/env of a container, probes, restarts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from hack.podrunner import pods

POD: dict[str, Any] = {
    "metadata": {"name": "rt-0", "namespace": "ml", "uid": "u1"},
    "spec": {"nodeName": "local-0", "containers": [{"name": "runtime", "image": "img"}]},
    "status": {},
}


@pytest.mark.parametrize(
    ("cidr", "taken", "expected"),
    [
        ("127.70.0.0/24", set(), "127.70.0.2"),
        ("127.70.0.0/24", {"127.70.0.2", "127.70.0.3"}, "127.70.0.4"),
        ("127.70.1.0/30", set(), "127.70.1.2"),
    ],
)
def test_next_pod_ip_skips_the_node_address_and_taken_ones(
    cidr: str, taken: set[str], expected: str
) -> None:
    assert pods.next_pod_ip(cidr, taken) == expected


def test_next_pod_ip_reports_exhaustion() -> None:
    with pytest.raises(ValueError, match="no free address"):
        pods.next_pod_ip("127.70.1.0/30", {"127.70.1.2"})


@pytest.mark.parametrize(
    ("container", "expected_tail"),
    [
        (
            {"name": "c", "command": ["python3"], "args": ["--port", "8000"]},
            ["--port", "8000", "--host", "127.70.0.2"],
        ),
        ({"name": "c", "command": ["python3", "--host", "0.0.0.0"]}, ["--host", "127.70.0.2"]),
    ],
)
def test_argv_binds_the_pod_ip(container: dict[str, Any], expected_tail: list[str]) -> None:
    argv = pods.container_argv(container, "127.70.0.2", [Path(sys.executable).parent])
    assert Path(argv[0]).is_file()
    assert argv[-len(expected_tail) :] == expected_tail


def test_argv_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="has no command"):
        pods.container_argv({"name": "c"}, "127.0.0.2", [])
    with pytest.raises(ValueError, match="'no-such-binary-xyz' not found"):
        pods.container_argv({"name": "c", "command": ["no-such-binary-xyz"]}, "127.0.0.2", [])


def test_env_resolves_values_and_downward_api_fields() -> None:
    container = {
        "name": "c",
        "env": [
            {"name": "A", "value": "1"},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ],
    }
    assert pods.container_env(POD, container, "127.70.0.9") == {
        "A": "1",
        "POD": "rt-0",
        "IP": "127.70.0.9",
    }


@pytest.mark.parametrize(
    ("probe", "expected"),
    [
        (None, None),
        ({"exec": {"command": ["true"]}}, None),
        ({"httpGet": {"path": "/ready", "port": 8000}}, "http://127.1.0.2:8000/ready"),
        ({"httpGet": {"path": "/health", "port": "http"}}, "http://127.1.0.2:8080/health"),
    ],
)
def test_probe_url(probe: dict[str, Any] | None, expected: str | None) -> None:
    container = {"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}
    assert pods.probe_url(probe, container, "127.1.0.2") == expected


@pytest.mark.parametrize(
    ("policy", "code", "restart"),
    [
        ("Always", 0, True),
        ("Always", 1, True),
        ("OnFailure", 0, False),
        ("OnFailure", 2, True),
        ("Never", 1, False),
    ],
)
def test_restart_policy(policy: str, code: int, restart: bool) -> None:
    assert pods.should_restart(policy, code) is restart


def test_status_documents() -> None:
    running = pods.running_status(POD, "127.70.0.2", True, 2, "2026-01-01T00:00:00Z")
    ready = {c["type"]: c["status"] for c in running["conditions"]}
    assert running["podIP"] == "127.70.0.2" and ready["Ready"] == "True"
    assert running["containerStatuses"][0]["restartCount"] == 2
    failed = pods.terminated_status(POD, 1, 0)
    assert failed["phase"] == "Failed"
    assert failed["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 1
    assert pods.terminated_status(POD, 0, 0)["phase"] == "Succeeded"
