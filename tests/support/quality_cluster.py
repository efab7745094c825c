"""Reading a ModelDeployment's quality evaluation back from the dev cluster: its status, a
condition, its eval Jobs."""

from __future__ import annotations

from typing import Any

from tests.support.operator_cluster import (
    get,
)


def status(cluster: Any, namespace: str, name: str) -> dict[str, Any]:
    return dict(get(cluster, "modeldeployment", name, "-n", namespace).get("status") or {})


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def eval_jobs(cluster: Any, namespace: str) -> list[dict[str, Any]]:
    return list(get(cluster, "jobs", "-n", namespace, "-l", "kvpilot.dev/quality-eval")["items"])


def under_the_gate(
    md: dict[str, Any], levels: list[str], metric: str, max_loss: float
) -> dict[str, Any]:
    """`md` with its levels measured on ConfigMap tiny-eval (key eval.txt) and no replicas: the
    plan is what these tests look at."""
    md["spec"]["autoscaling"] = {"mode": "off", "replicas": 0}
    md["spec"]["quantization"] = {
        "allowed": levels,
        "evaluation": {
            "dataset": {"configMap": "tiny-eval", "key": "eval.txt"},
            "metric": metric,
            "maxQualityLoss": max_loss,
        },
    }
    return md
