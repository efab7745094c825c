"""Pinned versions and where the dev cluster keeps its binaries and its state.

Binaries are cached outside the clone (a fresh CI clone reuses them), keyed by version, so a new
pin builds anew and an unchanged one is never rebuilt.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
GOTOOLS = REPO_ROOT / "hack" / "gotools"
NODEPOOLS = REPO_ROOT / "hack" / "nodepools.yaml"
KWOK_STAGES = REPO_ROOT / "hack" / "kwok" / "stages.yaml"

KUBERNETES_VERSION = "v1.37.2"
ETCD_VERSION = "v3.6.16"  # also pinned in hack/gotools/etcd/go.mod
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.22.0"
# Prometheus 3.16.0 (its Go module is tagged v0.316.0). Debian's package is built without the
# Kubernetes service discovery the dev cluster needs, so we build it, with only that discovery.
PROMETHEUS_VERSION = "v0.316.0"
PROMETHEUS_RELEASE = "3.16.0"
# kube-score: the workload security linter the chart tests run (tests/helm).
KUBE_SCORE_VERSION = "v1.20.0"
# actionlint: the GitHub Actions workflow linter (tests/packaging/test_release.py).
ACTIONLINT_VERSION = "v1.7.12"
# SeaweedFS (`weed`): the dev cluster's S3-compatible model store. Its module is untagged on the
# proxy; this pseudo-version is pinned in hack/gotools/seaweedfs/go.mod too.
SEAWEEDFS_VERSION = "v0.0.0-20261109003541-7506e5f91cd6"
# Gateway API Inference Extension: its InferencePool CRD (inference.networking.k8s.io/v1), for
# the operator's interop tests; only the CRD file is used, straight from the module.
INFERENCE_EXTENSION_VERSION = "v1.2.0"


def cache_dir() -> Path:
    return Path(os.environ.get("KVPILOT_CACHE_DIR", Path.home() / ".cache" / "kvpilot"))


def default_state_dir() -> Path:
    return Path(os.environ.get("KVPILOT_DEVCLUSTER_DIR", REPO_ROOT / ".devcluster"))


@dataclass(frozen=True)
class Component:
    """One cached build: the binaries it yields and the folder they live in."""

    name: str
    version: str
    binaries: tuple[str, ...]

    @property
    def bin_dir(self) -> Path:
        return cache_dir() / "bin" / f"{self.name}-{self.version}"

    def path(self, binary: str) -> Path:
        return self.bin_dir / binary

    def is_built(self) -> bool:
        return all(self.path(b).is_file() for b in self.binaries)


KUBERNETES = Component(
    "kubernetes",
    KUBERNETES_VERSION,
    ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"),
)
ETCD = Component("etcd", ETCD_VERSION, ("etcd",))
KWOK = Component("kwok", KWOK_VERSION, ("kwok",))
HELM = Component("helm", HELM_VERSION, ("helm",))
PROMETHEUS = Component("prometheus", PROMETHEUS_VERSION, ("prometheus",))
KUBE_SCORE = Component("kube-score", KUBE_SCORE_VERSION, ("kube-score",))
SEAWEEDFS = Component("seaweedfs", SEAWEEDFS_VERSION, ("weed",))
ACTIONLINT = Component("actionlint", ACTIONLINT_VERSION, ("actionlint",))
COMPONENTS = (ETCD, KUBERNETES, KWOK, HELM, PROMETHEUS, KUBE_SCORE, SEAWEEDFS, ACTIONLINT)


@dataclass(frozen=True)
class ModuleFile:
    """One file of a Go module at a pinned version, kept under the cache by version."""

    module: str
    version: str
    path: str  # inside the module

    @property
    def cached(self) -> Path:
        folder = f"{self.module.rsplit('/', 1)[-1]}-{self.version}"
        return cache_dir() / "go-files" / folder / Path(self.path).name


INFERENCE_POOL_CRD = ModuleFile(
    "sigs.k8s.io/gateway-api-inference-extension",
    INFERENCE_EXTENSION_VERSION,
    "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",
)


def bin_path_entries() -> list[Path]:
    """Folders to put on PATH so `kubectl` and `helm` are the pinned builds."""
    return [KUBERNETES.bin_dir, HELM.bin_dir]


def kube_env(kubeconfig: Path) -> dict[str, str]:
    """This process's environment with KUBECONFIG and the pinned kubectl/helm first on PATH."""
    path = os.pathsep.join([*map(str, bin_path_entries()), os.environ.get("PATH", "")])
    return {**os.environ, "KUBECONFIG": str(kubeconfig), "PATH": path}
