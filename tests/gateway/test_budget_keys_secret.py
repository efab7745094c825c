"""Keys from a Kubernetes Secret, on the dev cluster's real apiserver: `kvpilot-gateway
--discovery kubernetes --keys-secret NS/NAME` admits the keys the Secret's keys.yaml names (by
sha256), and follows the Secret when it changes (a rotated key works, the old one is refused)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hack import closedloop
from hack.devcluster import procs
from kvpilot.gateway.budget.config import hash_key
from tests.support.kube import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
SECRET = "gateway-keys"


def apply_keys_secret(cluster: Any, *keys: str) -> None:
    document = {"keys": [{"keySha256": hash_key(key), "team": "kube"} for key in keys]}
    secret = {"apiVersion": "v1", "kind": "Secret",
              "metadata": {"name": SECRET, "namespace": "default"},
              "stringData": {"keys.yaml": json.dumps(document)}}  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=json.dumps(secret))


@pytest.fixture
def gateway(cluster: Any) -> Iterator[str]:
    if not hasattr(cluster, "start_process"):
        pytest.skip("needs the dev cluster")
    closedloop.apply_crds(cluster)
    apply_keys_secret(cluster, "sk-kube-1")
    port = procs.free_port()
    argv = [sys.executable, "-m", "kvpilot.gateway.cli", "--discovery=kubernetes",
            "--namespace=default", f"--kubeconfig={cluster.kubeconfig}", f"--port={port}",
            "--host=127.0.0.1", f"--keys-secret=default/{SECRET}", "--keys-refresh=1"]  # fmt: skip
    env = {**cluster.env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    cluster.start_process("keys-gateway", argv, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: procs.http_ok(f"{url}/health"), 60, "the gateway")
    try:
        yield url
    finally:
        cluster.stop_process("keys-gateway")
        cluster.kubectl("delete", "secret", SECRET, "--wait=false", check=False)


def status_with(url: str, key: str | None) -> int:
    """The status for a model nobody serves: 404 once the key is admitted, 401 before."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "nobody-serves-this", "prompt": "hi", "max_tokens": 1}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=10).status_code


def test_keys_come_from_the_secret_and_follow_its_changes(cluster: Any, gateway: str) -> None:
    wait_until(lambda: status_with(gateway, "sk-kube-1") == 404, 30, "sk-kube-1 admitted")
    assert status_with(gateway, None) == 401
    assert status_with(gateway, "sk-kube-2") == 401
    apply_keys_secret(cluster, "sk-kube-2")  # rotated
    wait_until(lambda: status_with(gateway, "sk-kube-2") == 404, 30, "sk-kube-2 admitted")
    assert status_with(gateway, "sk-kube-1") == 401
