"""Which ModelDeployments an event on another object asks to pass, from the index (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.reconcile import dependents, manifests

URI = "hf://Qwen/Qwen2.5-0.5B-Instruct"


def indexed(name: str, namespace: str = "ns", **spec: Any) -> dict[str, Any]:
    return dependents.indexed(namespace, name, {"model": {"uri": URI}, **spec})


CACHED: dict[str, Any] = {"model": {"uri": URI, "cache": {"size": "10Gi"}}}
EVALUATED: dict[str, Any] = {
    "quantization": {"evaluation": {"configMap": {"name": "evals", "key": "x"}}}
}
MDS = [
    indexed("plain"),
    indexed("falls-back", routing={"fallbacks": [{"modelDeployment": "big"}]}),
    indexed("falls-elsewhere", routing={"fallbacks": [{"provider": "openai"}]}),
    indexed("other-ns", namespace="other", routing={"fallbacks": [{"modelDeployment": "big"}]}),
    indexed("pooled", routing={"endpointPickerRef": {"name": "epp"}}),
    indexed("cached", **CACHED),
    indexed("cached-other-ns", namespace="other", **CACHED),
    indexed("evaluated", **EVALUATED),
    indexed("evaluated-other-model", **EVALUATED, model={"uri": "hf://x/y"}),
]


@pytest.mark.parametrize(
    ("users", "expected"),
    [
        (lambda: dependents.fallback_users(MDS, "ns", "big"), [("ns", "falls-back")]),
        (lambda: dependents.fallback_users(MDS, "ns", "nobody"), []),
        (lambda: dependents.pool_users(MDS), [("ns", "pooled")]),
        (
            lambda: dependents.cache_users(MDS, "ns", manifests.cache_claim_name(URI)),
            [("ns", "cached")],
        ),
        (
            lambda: dependents.eval_users(MDS, "ns", quality_job.cache_name(URI)),
            [("ns", "evaluated")],
        ),
    ],
)
def test_an_event_passes_exactly_the_model_deployments_that_refer_to_its_object(
    users: Any, expected: list[tuple[str, str]]
) -> None:
    assert users() == expected
