"""Fixtures shared by every test suite.

`cluster` is a real control plane (hack/devcluster): started once per test run in a temporary
state dir and stopped at the end — or an existing cluster when KUBECONFIG points at one. With
KVPILOT_DEVCLUSTER_IMAGES=1 its `local` pool runs kvpilot's pods from the images `make images`
cached (`make cluster-up IMAGES=1`), so the cluster and e2e tests exercise what the images hold.
`hf_endpoint` (a Hugging Face hub URL serving `kvpilot/tiny-llama`) and `s3_endpoint` (an
S3Endpoint whose bucket holds `tiny-llama/`) are the dev cluster's model servers, run standalone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hack.closedloop import apply_crds
from hack.devcluster import DevCluster, existing
from hack.devcluster.versions import HELM
from tests.support import model_sources
from tests.support.model_sources import S3Endpoint
from tests.support.operator_cluster import Operator


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests sit in one folder per component; their cost is a marker. A test that uses the control
    plane is `cluster` whether or not its file says so, and tests/e2e is `e2e`, so
    `-m "not cluster"` runs everything that needs no control plane."""
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)
        if "e2e" in item.path.relative_to(item.config.rootpath).parts[:2]:
            item.add_marker(pytest.mark.e2e)


class ExistingCluster(existing.ExistingCluster):
    @property
    def prometheus_url(self) -> str:
        if not os.environ.get("PROMETHEUS_URL"):
            pytest.skip("set PROMETHEUS_URL to run Prometheus tests against an existing cluster")
        return super().prometheus_url


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster | ExistingCluster]:
    if os.environ.get("KUBECONFIG"):
        yield ExistingCluster(Path(os.environ["KUBECONFIG"]))
        return
    images = os.environ.get("KVPILOT_DEVCLUSTER_IMAGES") == "1"
    dev = DevCluster(tmp_path_factory.mktemp("devcluster"), images=images)
    try:
        dev.up()
        yield dev
    finally:
        dev.down()


@pytest.fixture(scope="module")
def crds(cluster: Any) -> None:
    apply_crds(cluster)


@pytest.fixture
def operator(cluster: Any, crds: None, tmp_path: Path) -> Iterator[Operator]:
    """The real operator (`kvpilot-operator run`) against the cluster, one per test."""
    op = Operator(cluster, tmp_path / "operator.log")
    op.start()
    yield op
    op.stop()


@pytest.fixture(scope="session")
def helm_binary() -> Path:
    return HELM.path("helm")


@pytest.fixture(scope="session")
def hf_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """HF_ENDPOINT of a Hugging Face hub (olah, offline) serving repo `kvpilot/tiny-llama`."""
    existing = model_sources.existing_hf_endpoint()
    if existing:
        yield existing
        return
    with model_sources.hf_hub(tmp_path_factory.mktemp("hf-hub")) as url:
        yield url


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """An S3 store (SeaweedFS): endpoint_url, access_key, secret_key, bucket (`models`), region."""
    existing = model_sources.existing_s3_endpoint()
    if existing:
        yield existing
        return
    with model_sources.s3_store(tmp_path_factory.mktemp("s3")) as endpoint:
        yield endpoint
