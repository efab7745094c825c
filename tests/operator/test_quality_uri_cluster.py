"""Eval sets named by URI on the dev cluster: real eval Jobs on the `local` pool fetch the set from
the dev cluster's S3 store and Hugging Face server (with the model's Secret and the endpoints of
spec.runtime.env) or mount it from a claim, measure, and report the digest of the bytes they read;
a set that cannot be fetched fails its Job, whose log tail QualityMeasured carries."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from hack.devcluster.modelsources import S3Endpoint, s3_client
from tests.support.operator_cluster import (
    ROOT,
    TINY_FACTS,
    Operator,
    apply_doc,
    apply_secret,
    get,
    model_server_env,
    tiny_llama_from,
    wait_for,
)
from tests.support.quality_cluster import condition, eval_jobs, status

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
URI = "hf://kvpilot/tiny-llama"
EVAL_TEXT = ROOT / "models" / "tiny-llama" / "eval.txt"
BUCKET = "models"


def with_eval_uri(cluster: Any, name: str, dataset_uri: str) -> dict[str, Any]:
    """tiny-llama whose one level (int8) is measured on the set at `dataset_uri`."""
    md = tiny_llama_from(URI, cluster, "model-creds", TINY_FACTS)
    md["metadata"]["name"] = name
    md["spec"]["autoscaling"] = {"mode": "off", "replicas": 0}  # the measurement is what is tested
    evaluation = {"dataset": {"uri": dataset_uri}, "metric": "agreement", "maxQualityLoss": 100}
    md["spec"]["quantization"] = {"allowed": ["int8"], "evaluation": evaluation}
    return md


def measured(cluster: Any, namespace: str, name: str) -> dict[str, Any]:
    now = status(cluster, namespace, name)
    found = condition(now, "QualityMeasured")
    if found.get("status") != "True":
        raise AssertionError(f"QualityMeasured: {found}")
    return now


def fill_claim(cluster: Any, namespace: str, claim: str, path: str, data: bytes) -> None:
    """A claim of the dev cluster's local storage holding `data` at `path`: its volume is a
    directory on this machine (hack/podrunner/provisioner.py), written here as a user would
    copy an eval set onto a shared volume."""
    doc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Mi"}}},
    }
    apply_doc(cluster, namespace, doc)

    def bound_dir() -> str:
        volume = get(cluster, "pvc", claim, "-n", namespace)["spec"].get("volumeName")
        return str(get(cluster, "pv", volume)["spec"]["hostPath"]["path"]) if volume else ""

    target = Path(wait_for(bound_dir, f"claim {claim} bound")) / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_eval_sets_from_s3_and_hf_are_fetched_by_the_job_and_a_missing_one_says_why(
    cluster: Any, operator: Operator, namespace: str
) -> None:
    env = model_server_env(cluster)
    s3 = S3Endpoint(
        env["AWS_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], BUCKET
    )
    short = EVAL_TEXT.read_text()[:3000].encode()  # few tokens: a quick eval on a CPU
    key = f"evals/{namespace}/tiny-short.txt"
    s3_client(s3).put_object(Bucket=BUCKET, Key=key, Body=short)
    creds = {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    apply_secret(cluster, namespace, "model-creds", {"HF_TOKEN": "unused-here", **creds})

    pvc_text = EVAL_TEXT.read_text()[3000:6000].encode()
    fill_claim(cluster, namespace, "eval-sets", "tiny/eval.txt", pvc_text)

    apply_doc(cluster, namespace, with_eval_uri(cluster, "from-s3", f"s3://{BUCKET}/{key}"))
    apply_doc(
        cluster, namespace, with_eval_uri(cluster, "from-pvc", "pvc://eval-sets/tiny/eval.txt")
    )
    apply_doc(cluster, namespace, with_eval_uri(cluster, "from-hf", f"{URI}/eval.txt"))
    missing = f"s3://{BUCKET}/evals/{namespace}/no-such.txt"
    apply_doc(cluster, namespace, with_eval_uri(cluster, "missing", missing))

    from_s3 = wait_for(lambda: measured(cluster, namespace, "from-s3"), "s3 set", operator, 600)
    (row,) = from_s3["quality"]
    assert row["level"] == "int8" and row["datasetDigest"] == sha256(short)
    assert row["nodeType"] == "local" and row["reference"] == "bf16" and 0 < row["value"] <= 1
    assert from_s3["quantization"] == "int8"

    from_hf = wait_for(lambda: measured(cluster, namespace, "from-hf"), "hf set", operator, 600)
    (row,) = from_hf["quality"]
    assert row["datasetDigest"] == sha256(EVAL_TEXT.read_bytes())  # the file the hub serves

    from_pvc = wait_for(lambda: measured(cluster, namespace, "from-pvc"), "pvc set", operator, 600)
    (row,) = from_pvc["quality"]
    assert row["datasetDigest"] == sha256(pvc_text)  # read from the claim, mounted read-only

    def eval_failed() -> str:
        found = condition(status(cluster, namespace, "missing"), "QualityMeasured")
        return str(found.get("message", "")) if found.get("reason") == "EvalFailed" else ""

    message = wait_for(eval_failed, "the missing set's Job to fail", operator, timeout=600)
    assert f"kvpilot-runtime eval: {missing}: 404 bucket or key not found" in message
    # until measured, the category decides: int8 still serves
    assert status(cluster, namespace, "missing")["quantization"] == "int8"
    # the measured sets' Jobs were read and deleted; the failed one stays until its TTL (10 min)
    names = [j["metadata"]["name"] for j in eval_jobs(cluster, namespace)]
    assert len(names) == 1, names
