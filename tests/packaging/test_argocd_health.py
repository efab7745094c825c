"""The Argo CD health check (examples/argocd/health.lua), run by a real Lua interpreter (lupa)
on statuses built by the operator's own condition logic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.operator.reconcile import conditions

lupa = pytest.importorskip("lupa", reason="lupa (PyPI) runs the Lua health check")

ROOT = Path(__file__).resolve().parents[2]
HEALTH = ROOT / "examples" / "argocd" / "health.lua"
CM_PATCH = ROOT / "examples" / "argocd" / "argocd-cm-patch.yaml"
KEY = "resource.customizations.health.kvpilot.dev_ModelDeployment"


def health(obj: dict[str, Any]) -> tuple[str, str]:
    """What Argo CD does: a fresh Lua state, `obj` as a global, the script's returned table."""
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(HEALTH.read_text())
    return str(result["status"]), str(result["message"])


def md(generation: int, status: dict[str, Any] | None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "m", "namespace": "ns", "generation": generation},
        "spec": {"model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"}},
    }
    if status is not None:
        obj["status"] = status
    return obj


def status_of(
    rollout: conditions.Rollout,
    plan_error: str | None = None,
    num_unplaceable: int = 0,
    observed: int = 1,
) -> dict[str, Any]:
    computed = conditions.compute(plan_error, "l4-24gb: int8 x2", rollout, num_unplaceable, 1)
    merged = conditions.merge([], computed, "2026-01-01T00:00:00Z")
    return {
        "observedGeneration": observed,
        "conditions": [c.model_dump(by_alias=True, exclude_none=True) for c in merged],
    }


ALL_READY = conditions.Rollout(replicas=2, ready=2, updated=2, is_settled=True)
ROLLING = conditions.Rollout(replicas=2, ready=1, updated=1, is_settled=False)
ZERO = conditions.Rollout(replicas=0, ready=0, updated=0, is_settled=True)


@pytest.mark.parametrize(
    ("obj", "want", "message_has"),
    [
        (md(1, None), "Progressing", "Waiting for the kvpilot operator"),
        (md(1, {"observedGeneration": 1, "conditions": []}), "Progressing", "Waiting"),
        (md(1, status_of(ALL_READY)), "Healthy", "2/2 replicas ready"),
        (md(1, status_of(ROLLING)), "Progressing", "1/2 replicas ready"),
        (md(1, status_of(ZERO)), "Healthy", "Scaled to zero"),
        (md(1, status_of(ZERO, plan_error="no node type fits: 70B")), "Degraded", "PlanFailed"),
        (md(1, status_of(ROLLING, num_unplaceable=1)), "Degraded", "InsufficientGPUs"),
        # ready, but for the previous spec: the new generation is still being reconciled
        (md(2, status_of(ALL_READY, observed=1)), "Progressing", "Generation 2"),
    ],
)
def test_health_follows_the_ready_condition(
    obj: dict[str, Any], want: str, message_has: str
) -> None:
    status, message = health(obj)
    assert status == want
    assert message_has in message


def test_a_status_without_ready_is_progressing() -> None:
    only_planned = {"observedGeneration": 1, "conditions": [{"type": "Planned", "status": "True"}]}
    assert health(md(1, only_planned)) == ("Progressing", "Waiting for the Ready condition")


def test_configmap_patch_carries_the_same_script() -> None:
    patch = yaml.safe_load(CM_PATCH.read_text())
    assert patch["data"][KEY] == HEALTH.read_text()
