"""Helpers of the cluster tests on spec.model.variants: the runtime's own greedy text for a
checkpoint (what a variant's pod must answer), and a tiny-llama ModelDeployment whose quality gate
measures a compressed-tensors int4 variant."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from bench.reference.models import run_all
from bench.reference.prequantized import write_checkpoint
from hack.devcluster.modelsources import S3Endpoint, s3_client, upload_model
from kvpilot.contract import serve_config
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.models.tokenizer_files import Tokenizer
from kvpilot.runtime.server.lifecycle import engine_config
from tests.support.operator_cluster import ROOT, apply_secret, model_server_env, tiny_llama_from
from tests.support.quality_cluster import condition, eval_jobs, status, under_the_gate

BUCKET = "models"
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
    return under_the_gate(md, LEVELS, METRIC, max_loss)


def measured(cluster: Any, namespace: str) -> dict[str, Any]:
    now = status(cluster, namespace, "tiny")
    found = condition(now, "QualityMeasured")
    if found.get("status") != "True":
        jobs = [(j["metadata"]["name"], j.get("status")) for j in eval_jobs(cluster, namespace)]
        raise AssertionError(f"QualityMeasured: {found}; jobs: {jobs}")
    return now


@dataclasses.dataclass(frozen=True)
class Int4Variant:
    uri: str  # where the dev cluster's S3 store holds it
    local: Path  # the same checkpoint here, for the runtime's in-process answer


def int4_variant_in_s3(cluster: Any, namespace: str, tmp_path: Path) -> Int4Variant:
    """A compressed-tensors int4 checkpoint of tiny-llama, written by the real library, uploaded
    to the dev cluster's S3 store; Secret `model-creds` holds the store's keys."""
    env = model_server_env(cluster)
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    s3 = S3Endpoint(
        env["AWS_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], BUCKET
    )
    local = write_checkpoint(tmp_path / "int4", "int4-g128")
    prefix = f"{namespace}/tiny-int4"
    upload_model(s3_client(s3), BUCKET, local, prefix + "/")
    apply_secret(cluster, namespace, "model-creds", {k: env[k] for k in keys})
    return Int4Variant(f"s3://{BUCKET}/{prefix}", local)


def eval_set_config_map(cluster: Any, namespace: str, tmp_path: Path) -> None:
    """ConfigMap `tiny-eval` (key eval.txt): the first EVAL_CHARS of tiny-llama's eval text."""
    dataset = tmp_path / "eval.txt"
    dataset.write_text((ROOT / "models" / "tiny-llama" / "eval.txt").read_text()[:EVAL_CHARS])
    cluster.kubectl(
        "create", "configmap", "tiny-eval", "-n", namespace, f"--from-file=eval.txt={dataset}"
    )
