"""A tiny-llama ModelDeployment with an eval set, its reference plan, and the eval Jobs and pods
the quality tests read back."""

from __future__ import annotations

import json
from typing import Any

from kvpilot.contract.memory import ModelFacts
from kvpilot.operator import api
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning import planner
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.quality import job as quality_job

CONFIG = OperatorConfig(runtime_image="registry.local/kvpilot-runtime:test")


URI = "hf://kvpilot/tiny-llama"


TINY = {"parameters": 3819776, "layers": 4, "kvHeads": 2, "headDim": 32, "vocabSize": 4096}


L4 = NodeType("l4", "NVIDIA-L4", 23034, 1, 0.98, {"kvpilot.dev/node-type": "l4"}, ("n0",), (1,))


DIGEST = "sha256:" + "ab" * 32


NOW = "2026-12-03T20:00:00Z"


def policy(**fields: Any) -> api.QuantizationPolicy:
    return api.QuantizationPolicy.model_validate(fields)


def evaluation(max_loss: float = 0.5, metric: str = "perplexity") -> dict[str, Any]:
    return {
        "dataset": {"configMap": "tiny-eval", "key": "eval.txt"},
        "metric": metric,
        "maxQualityLoss": max_loss,
    }


def md_spec(**quantization: Any) -> dict[str, Any]:
    return {
        "model": {"uri": URI, **TINY},
        "serving": {"maxContextLength": 256, "targetConcurrency": 2},
        "quantization": {"allowed": ["bf16", "int8", "int4"], **quantization},
        "placement": {"nodeTypes": ["l4"]},
    }


def md(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "tiny", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": spec,
    }


def reference() -> planner.NodePlan:
    s = api.parse_spec(md_spec(evaluation=evaluation()))
    request = planner.PlanRequest.from_spec(s, ModelFacts(3819776, 4, 2, 32, 4096))
    found = planner.reference_plan(request, [L4], quality_job.EVAL_WINDOW_TOKENS)
    assert found is not None
    return found


def summary_pod(level: str, value: float, loss: float, phase: str = "Succeeded") -> dict[str, Any]:
    summary = {
        "metric": "perplexity",
        "dataset_digest": DIGEST,
        "num_samples": 3,
        "baseline": 140.0,
        "levels": {level: {"value": value, "relative_loss": loss, "weight_bytes": 1}},
    }
    terminated = {"message": json.dumps(summary)}
    return {
        "metadata": {"creationTimestamp": NOW},
        "status": {"phase": phase, "containerStatuses": [{"state": {"terminated": terminated}}]},
    }


def failed_pod(created: str, log: str) -> dict[str, Any]:
    terminated = {"message": log}
    return {
        "metadata": {"creationTimestamp": created},
        "status": {"phase": "Failed", "containerStatuses": [{"state": {"terminated": terminated}}]},
    }


def job(condition: str | None) -> dict[str, Any]:
    conditions = [] if condition is None else [{"type": condition, "status": "True"}]
    if condition == "Failed":
        conditions[0]["reason"] = "BackoffLimitExceeded"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": "j",
            "namespace": "ns",
            "annotations": {"kvpilot.dev/node-type": "l4"},
        },
        "status": {"conditions": conditions},
    }
