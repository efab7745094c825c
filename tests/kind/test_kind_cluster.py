"""The dev cluster smoke check on a kind cluster (pytest-kind), where Docker exists."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.kind


def test_kind_cluster_runs_a_deployment(kind_cluster: Any) -> None:
    kind_cluster.kubectl("create", "deployment", "hello", "--image=registry.k8s.io/pause:3.10")
    kind_cluster.kubectl("rollout", "status", "deployment/hello", "--timeout=120s")
    assert "hello" in kind_cluster.kubectl("get", "deployments")
