"""`kvpilot-runtime eval --dataset URI` against the real model servers the dev cluster runs (olah
as the Hugging Face hub, SeaweedFS as S3): the eval set is fetched, measured, and its digest is
of the bytes fetched; a set that cannot be fetched is one line naming the URI and the cause."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hack.devcluster.modelsources import s3_client
from tests.support.model_sources import HF_REPO_ID, MODEL_DIR, S3Endpoint, hf_env, s3_env

pytestmark = pytest.mark.slow  # fetches from the dev cluster's model servers
EVAL_TEXT = MODEL_DIR / "eval.txt"


def run_eval(dataset: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # Level `none` only: the baseline pass alone, so the test costs one pass over the set.
    command = [sys.executable, "-m", "kvpilot.runtime.cli", "eval", "--model", str(MODEL_DIR)]
    argv = [*command, "--dataset", dataset, "--quantization", "none", "--json"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_an_hf_dataset_is_fetched_and_its_digest_is_the_files(
    hf_endpoint: str, tmp_path: Path
) -> None:
    uri = f"hf://{HF_REPO_ID}/eval.txt"  # a file of the model repo the hub serves
    done = run_eval(uri, hf_env(hf_endpoint, tmp_path))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["dataset"] == uri
    assert result["dataset_digest"] == sha256(EVAL_TEXT.read_bytes())
    assert result["num_tokens"] > 8000  # the whole file was scored
    # the same bytes from a local path measure the same
    local = json.loads(run_eval(str(EVAL_TEXT), hf_env(hf_endpoint, tmp_path)).stdout)
    assert local["baseline"]["value"] == result["baseline"]["value"]


def test_an_s3_dataset_is_fetched_by_its_key(s3_endpoint: S3Endpoint, tmp_path: Path) -> None:
    text = EVAL_TEXT.read_text()[:3000].encode()
    key = "evals/tiny-short.txt"
    s3_client(s3_endpoint).put_object(Bucket=s3_endpoint.bucket, Key=key, Body=text)
    uri = f"s3://{s3_endpoint.bucket}/{key}"
    done = run_eval(uri, s3_env(s3_endpoint))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["dataset_digest"] == sha256(text)
    assert 0 < result["num_tokens"] < 2000


def test_a_dataset_that_cannot_be_fetched_is_one_line(
    hf_endpoint: str, s3_endpoint: S3Endpoint, tmp_path: Path
) -> None:
    env = {**hf_env(hf_endpoint, tmp_path), **s3_env(s3_endpoint)}
    cases = {
        f"s3://{s3_endpoint.bucket}/evals/no-such.txt": "404 bucket or key not found",
        f"hf://{HF_REPO_ID}/no-such.txt": "404",
        "hf://kvpilot/no-such-repo/eval.txt": "404 repository not found",
        "pvc://claim/eval.txt": "mounted by the eval Job",
    }
    for uri, cause in cases.items():
        done = run_eval(uri, env)
        assert done.returncode == 2, (uri, done.stderr)
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"kvpilot-runtime eval: {uri}: "), last
        assert cause in last and "Traceback" not in done.stderr, (uri, done.stderr)
