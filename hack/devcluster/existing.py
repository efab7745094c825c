"""A cluster someone else runs (KUBECONFIG), with DevCluster's interface: what the tests and the
benchmarks drive when they are pointed at a real cluster instead of starting the dev one."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from hack.devcluster.versions import KUBERNETES, kube_env


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
            raise LookupError("set PROMETHEUS_URL: the Prometheus that scrapes this cluster's pods")
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
