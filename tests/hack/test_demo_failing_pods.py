"""The demo stops waiting for tiny-llama with the operator's reason once its pods fail, and a
checkout the local pool's pods cannot see is refused before anything is applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hack.closedloop import local_model_uri
from hack.demo import pods_failing
from hack.devcluster import DevClusterError
from kvpilot.contract import catalog
from kvpilot.operator import api
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning import planner
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.reconcile import conditions, manifests
from kvpilot.operator.reconcile.manifests import SCRATCH_MOUNT

CRASH = "runtime: CrashLoopBackOff: kvpilot-runtime serve: --model 'file:///m': not a checkpoint"


def status(pod_problems: tuple[str, ...], ready: int, num_unplaceable: int = 0) -> dict[str, Any]:
    """A ModelDeployment's status as the operator writes its conditions (JSON, by alias)."""
    rollout = conditions.Rollout(replicas=1, ready=ready, updated=1)
    found = conditions.compute(None, "plan", rollout, num_unplaceable, 1, pod_problems)
    return {
        "readyReplicas": ready,
        "conditions": [c.model_dump(mode="json", by_alias=True) for c in found],
    }


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (status((CRASH,), ready=0), CRASH),
        (status((), ready=0), None),  # still starting
        (status((), ready=1), None),
        (status((), ready=0, num_unplaceable=1), None),  # waiting for a GPU is not a failure
        ({}, None),  # no status written yet
    ],
)
def test_the_wait_ends_with_the_operators_reason_only_when_pods_fail(
    case: dict[str, Any], expected: str | None
) -> None:
    assert pods_failing(case) == expected


@pytest.mark.parametrize(
    ("path", "refused"),
    [
        (Path("/work/main/models/tiny-llama"), False),
        (Path("/home/me/kvpilot/models/tiny-llama"), False),
        (Path(SCRATCH_MOUNT) / "kvpilot/models/tiny-llama", True),
        (Path(SCRATCH_MOUNT + "-other/models/tiny-llama"), False),  # only below the mount
    ],
)
def test_a_checkout_under_the_runtime_pods_scratch_mount_is_refused(
    path: Path, refused: bool
) -> None:
    if refused:
        with pytest.raises(DevClusterError, match="clone the repository outside /tmp"):
            local_model_uri(path)
    else:
        assert local_model_uri(path) == f"file://{path}"


def test_the_runtime_pods_mount_their_scratch_emptydir_where_the_check_looks() -> None:
    """The other side of local_model_uri's check: the operator's runtime container."""
    spec = api.parse_spec({"model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"}})
    local = NodeType("local", "NVIDIA-L4", 23034, 1, 0.0, {}, ("local-0",), (1,))
    plan = planner.plan_node_type(
        planner.PlanRequest.from_spec(spec, catalog.resolve(spec.model)), local
    )
    md = {"metadata": {"name": "tiny", "namespace": "default", "uid": "u1", "generation": 1}}
    built = manifests.build_deployment(md, spec, plan, 1, OperatorConfig())
    (container,) = built["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["tmp"] == SCRATCH_MOUNT
