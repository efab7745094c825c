"""deploy/base (kustomize) installs what the chart installs: regenerated from the chart, checked
for drift, and rendered by kubectl's own kustomize."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack.devcluster.versions import KUBERNETES
from tests.support.helm_chart import CHART, ROOT, render, require

pytestmark = pytest.mark.slow  # runs helm (and kubeconform) on the chart

BASE = ROOT / "deploy" / "base"


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


def test_base_is_up_to_date_with_the_chart(helm_binary: Path) -> None:
    argv = [sys.executable, str(ROOT / "deploy" / "render.py"), "--check"]
    argv += ["--helm", str(require(helm_binary))]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_kustomize_renders_the_chart_install(helm_binary: Path) -> None:
    kubectl = require(KUBERNETES.path("kubectl"))
    out = subprocess.run(
        [str(kubectl), "kustomize", str(BASE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    kustomized = {key(o): o for o in yaml.safe_load_all(out) if o}
    chart = {key(o): o for o in render(require(helm_binary), extra=["--include-crds"])}
    namespace = ("Namespace", "", "kvpilot-system")
    assert set(kustomized) == set(chart) | {namespace}
    for k, obj in chart.items():
        assert kustomized[k] == obj, f"{k} differs between kustomize and helm"
    crd_files = sorted((CHART / "crds").glob("*.yaml"))
    assert sum(1 for k in kustomized if k[0] == "CustomResourceDefinition") == sum(
        len([d for d in yaml.safe_load_all(p.read_text()) if d]) for p in crd_files
    )


@pytest.mark.cluster
def test_kubectl_apply_k_installs_the_base(cluster: Any) -> None:
    """`kubectl apply -k deploy/base`: the plain-manifest install path, into the dev cluster."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(BASE))
    try:
        for path in (BASE / "operator.yaml", BASE / "namespace.yaml"):
            for obj in (o for o in yaml.safe_load_all(path.read_text()) if o):
                meta = obj["metadata"]
                scope = ["-n", meta["namespace"]] if "namespace" in meta else []
                cluster.kubectl("get", obj["kind"], meta["name"], *scope)
        cluster.kubectl("get", "crd", "modeldeployments.kvpilot.dev")
    finally:  # the CRDs stay, as with helm uninstall (other suites use them)
        for path in (BASE / "operator.yaml", BASE / "namespace.yaml"):
            cluster.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", str(path))
