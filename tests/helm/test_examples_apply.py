"""Server-side apply of the CRDs and of every example twice: the second apply changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.helm_chart import ROOT
from tests.support.kube import fresh_namespace, get_json

pytestmark = [pytest.mark.cluster]

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.fixture
def namespace(cluster: Any) -> Iterator[str]:
    with fresh_namespace(cluster, "ssa") as name:
        yield name


def versions(cluster: Any, path: Path, namespace: str = "") -> dict[str, str]:
    """resourceVersion of each object in `path`, as stored."""
    found = {}
    for doc in (d for d in yaml.safe_load_all(path.read_text()) if d):
        kind, name = doc["kind"], doc["metadata"]["name"]
        obj = get_json(cluster, kind, name, *(["-n", namespace] if namespace else []))
        found[f"{kind}/{name}"] = obj["metadata"]["resourceVersion"]
    return found


def apply(cluster: Any, path: Path, namespace: str = "") -> None:
    args = ["apply", "--server-side", "--field-manager=kvpilot-gitops", "-f", str(path)]
    cluster.kubectl(*args, *(["-n", namespace] if namespace else []))


def test_crds_apply_server_side_twice_without_change(cluster: Any) -> None:
    # --force-conflicts: other suites apply the same CRDs under kubectl's default manager
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        cluster.kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=kvpilot-gitops",
            "-f",
            str(path),
        )
        before = versions(cluster, path)
        apply(cluster, path)
        assert versions(cluster, path) == before, path.name


def test_crds_apply_client_side_too(cluster: Any) -> None:
    crds = sorted((ROOT / "crds").glob("*.yaml"))  # one CRD a file (kvpilot's own: one today)
    done = cluster.kubectl("apply", "--dry-run=server", "-f", str(ROOT / "crds"))
    assert crds and done.stdout.count("(server dry run)") == len(crds), done.stdout


def test_every_example_applies_twice_without_change(cluster: Any, namespace: str) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl(
        "wait", "--for=condition=established", "--timeout=60s", "crd/modeldeployments.kvpilot.dev"
    )
    assert len(EXAMPLES) >= 3
    for path in EXAMPLES:
        apply(cluster, path, namespace)
        before = versions(cluster, path, namespace)
        apply(cluster, path, namespace)
        assert versions(cluster, path, namespace) == before, path.name
        diff = cluster.kubectl(
            "diff",
            "--server-side",
            "--field-manager=kvpilot-gitops",
            "-n",
            namespace,
            "-f",
            str(path),
            check=False,
        )
        assert diff.returncode == 0, diff.stdout + diff.stderr
