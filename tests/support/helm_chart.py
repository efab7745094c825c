"""Helpers for the chart tests: run the pinned helm, render the chart, pick objects out."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack.devcluster import versions

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvpilot"
KUBE_SCORE_VERSION = "v1.20.0"


def require(binary: Path) -> Path:
    if not binary.is_file():
        pytest.skip(f"{binary} is not built (make cluster-build)")
    return binary


def kube_score_binary() -> Path:
    """kube-score from the version-keyed cache (hack/devcluster builds it with go install)."""
    component = getattr(versions, "KUBE_SCORE", None)
    if component is not None:
        return Path(component.path("kube-score"))
    return versions.cache_dir() / "bin" / f"kube-score-{KUBE_SCORE_VERSION}" / "kube-score"


def helm(
    binary: Path, *args: str, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(binary), *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"{binary.name} {' '.join(args)} failed:\n{done.stderr}")
    return done


def set_args(values: dict[str, str]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def render(
    binary: Path,
    values: dict[str, str] | None = None,
    namespace: str = "kvpilot-system",
    release: str = "kvpilot",
    extra: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """`helm template` with `--set` values, as parsed objects (empty documents dropped)."""
    argv = ["template", release, str(CHART), "--namespace", namespace, *extra]
    out = helm(binary, *argv, *set_args(values or {})).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def component(obj: dict[str, Any]) -> str:
    """The chart's part an object belongs to (`operator` or `gateway`; CRDs belong to none)."""
    labels = obj["metadata"].get("labels") or {}
    return str(labels.get("app.kubernetes.io/component", ""))


def find(
    objects: Iterable[dict[str, Any]],
    kind: str,
    name: str | None = None,
    part: str = "operator",
) -> dict[str, Any]:
    """The one object of `kind` (and `name`) of the chart's `part` (operator or gateway)."""
    matches = [
        o
        for o in objects
        if o["kind"] == kind and name in (None, o["metadata"]["name"]) and component(o) == part
    ]
    assert len(matches) == 1, f"want one {part} {kind} {name or ''}, got {len(matches)}"
    return matches[0]


def kinds(objects: Iterable[dict[str, Any]]) -> list[str]:
    return sorted(o["kind"] for o in objects)


def rules(objects: Iterable[dict[str, Any]], part: str = "operator") -> list[dict[str, Any]]:
    return [
        r
        for o in objects
        if o["kind"] in ("ClusterRole", "Role") and component(o) == part
        for r in o["rules"]
    ]


def container(objects: Iterable[dict[str, Any]], part: str = "operator") -> dict[str, Any]:
    (only,) = find(objects, "Deployment", part=part)["spec"]["template"]["spec"]["containers"]
    return only


def config_yaml(objects: Iterable[dict[str, Any]]) -> dict[str, Any]:
    cm = next(o for o in objects if o["kind"] == "ConfigMap" and "config.yaml" in o["data"])
    loaded: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
    return loaded
