"""Session fixtures shared by every test suite.

`cluster` is a real control plane (hack/devcluster): started once per test run in a temporary
state dir and stopped at the end — or an existing cluster when KUBECONFIG points at one.
`hf_endpoint` (a Hugging Face hub URL serving `kvpilot/tiny-llama`) and `s3_endpoint` (an
S3Endpoint whose bucket holds `tiny-llama/`) are the dev cluster's model servers, run standalone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hack.devcluster import DevCluster
from hack.devcluster.versions import HELM, KUBERNETES, kube_env
from tests.support import model_sources
from tests.support.model_sources import S3Endpoint


class ExistingCluster:
    """A cluster someone else runs (KUBECONFIG); the same interface as DevCluster."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig

    @property
    def env(self) -> dict[str, str]:
        return kube_env(self.kubeconfig)

    @property
    def prometheus_url(self) -> str:
        """The Prometheus that scrapes this cluster's pods (PROMETHEUS_URL)."""
        if not os.environ.get("PROMETHEUS_URL"):
            pytest.skip("set PROMETHEUS_URL to run Prometheus tests against an existing cluster")
        return os.environ["PROMETHEUS_URL"]

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        kubectl = KUBERNETES.path("kubectl")
        binary = str(kubectl) if kubectl.exists() else (shutil.which("kubectl") or "kubectl")
        return subprocess.run(
            [binary, *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=check,
        )

    def api_client(self) -> Any:
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster | ExistingCluster]:
    if os.environ.get("KUBECONFIG"):
        yield ExistingCluster(Path(os.environ["KUBECONFIG"]))
        return
    dev = DevCluster(tmp_path_factory.mktemp("devcluster"))
    try:
        dev.up()
        yield dev
    finally:
        dev.down()


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
