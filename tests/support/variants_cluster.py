"""Helpers of the cluster tests on spec.model.variants: the runtime's own greedy text for a
checkpoint (what a variant's pod must answer), and a tiny-llama ModelDeployment whose quality gate
measures a compressed-tensors int4 variant."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from bench.reference.models import run_all
from kvpilot.contract import serve_config
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.models.tokenizer_files import Tokenizer
from kvpilot.runtime.server.lifecycle import engine_config
from tests.support.operator_cluster import tiny_llama_from
from tests.support.quality_cluster import condition, eval_jobs, status

PROMPT = "The for statement"
NUM_TOKENS = 12


def in_process_greedy(checkpoint: Path, pod_args: list[str]) -> str:
    """The runtime's greedy text for PROMPT on `checkpoint`, its engine built here from the
    pod's own `serve` flags, as the runtime builds it (a small KV cache: one request)."""
    flags = serve_config.build_parser().parse_args(pod_args[1:])  # --model: the pod's path
    config = engine_config(serve_config.ServeConfig(**vars(flags)), str(checkpoint))
    config = dataclasses.replace(config, kv_cache_memory=16 * 2**20)
    tokenizer = Tokenizer(checkpoint)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0)
    (tokens,) = run_all(Engine(config), [tokenizer.encode(PROMPT)], params).values()
    return tokenizer.decode(tokens)


LEVELS = ["int4", "int8"]  # int4 preferred: the variant (pre-quantised) before kvpilot's own
METRIC = "agreement"  # ranks the levels on few tokens (test_quality_cluster.py says why)
EVAL_CHARS = 4000  # few tokens: each eval Job is quick on a CPU


def measured_variant_tiny(cluster: Any, variant_uri: str, max_loss: float) -> dict[str, Any]:
    md = tiny_llama_from("s3://models/tiny-llama", cluster, "model-creds")
    md["spec"]["model"]["variants"] = [{"name": "ct-int4", "uri": variant_uri}]
    md["spec"]["autoscaling"] = {"mode": "off", "replicas": 0}  # the plan is what is tested
    md["spec"]["quantization"] = {
        "allowed": LEVELS,
        "evaluation": {
            "dataset": {"configMap": "tiny-eval", "key": "eval.txt"},
            "metric": METRIC,
            "maxQualityLoss": max_loss,
        },
    }
    return md


def measured(cluster: Any, namespace: str) -> dict[str, Any]:
    now = status(cluster, namespace, "tiny")
    found = condition(now, "QualityMeasured")
    if found.get("status") != "True":
        jobs = [(j["metadata"]["name"], j.get("status")) for j in eval_jobs(cluster, namespace)]
        raise AssertionError(f"QualityMeasured: {found}; jobs: {jobs}")
    return now
