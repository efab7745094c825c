"""Pods stuck on a container (a failed model fetch, a missing Secret) reach the ModelDeployment's
conditions in the pod's own words."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator.planning import inventory
from kvpilot.operator.reconcile import conditions

FETCH_ERROR = "kvpilot-runtime fetch: hf://org/m: 404 repository not found, or private"


def pod(
    init: list[dict[str, Any]] | None = None, app: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Pending", "containerStatuses": app or []}
    if init is not None:
        status["initContainerStatuses"] = init
    return {"status": status}


def crash_looping(name: str, message: str) -> dict[str, Any]:
    return {
        "name": name,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "message": f"progress line\n{message}\n"}},
    }


def waiting(
    name: str, reason: str, message: str = "", exit_code: int | None = None
) -> dict[str, Any]:
    status: dict[str, Any] = {"name": name, "state": {"waiting": {"reason": reason}}}
    if message:
        status["state"]["waiting"]["message"] = message
    if exit_code is not None:
        status["lastState"] = {"terminated": {"exitCode": exit_code}}
    return status


CONFIG_ERROR = 'secret "creds" not found'


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (pod(), None),
        (pod(app=[{"name": "runtime", "state": {"running": {}}}]), None),
        (pod(init=[waiting("fetch-model", "PodInitializing")]), None),
        (
            pod(init=[crash_looping("fetch-model", FETCH_ERROR)]),
            f"fetch-model: CrashLoopBackOff: {FETCH_ERROR}",
        ),
        (
            pod(init=[waiting("fetch-model", "CreateContainerConfigError", CONFIG_ERROR)]),
            f"fetch-model: CreateContainerConfigError: {CONFIG_ERROR}",
        ),
        (
            pod(app=[waiting("runtime", "CrashLoopBackOff", exit_code=2)]),
            "runtime: CrashLoopBackOff: exit code 2",
        ),
    ],
)
def test_pod_problem(body: dict[str, Any], expected: str | None) -> None:
    assert conditions.pod_problem(body) == expected


def test_problems_make_the_model_deployment_degraded_and_say_why_it_is_not_ready() -> None:
    rollout = conditions.Rollout(replicas=1, ready=0, updated=1, is_settled=False)
    problem = f"fetch-model: CrashLoopBackOff: {FETCH_ERROR}"
    found = {c.type: c for c in conditions.compute(None, "plan", rollout, 0, 1, (problem,))}
    assert (found["Degraded"].status, found["Degraded"].reason) == ("True", "PodsFailing")
    assert found["Degraded"].message == problem
    assert found["Ready"].status == "False" and FETCH_ERROR in found["Ready"].message
    healthy = {c.type: c for c in conditions.compute(None, "plan", rollout, 0, 1)}
    assert healthy["Degraded"].status == "False"


def test_the_pod_index_keeps_the_problem() -> None:
    body = pod(init=[crash_looping("fetch-model", FETCH_ERROR)])
    body["metadata"] = {"name": "p", "namespace": "ns", "labels": {}}
    body["spec"] = {
        "nodeName": "n",
        "containers": [{"resources": {"requests": {"nvidia.com/gpu": "1"}}}],
    }
    trimmed = inventory.trim_pod(body)
    assert trimmed is not None and FETCH_ERROR in trimmed["status"]["problem"]
