"""`kvpilot-runtime fetch` and `serve --model hf://…` against the real model servers the dev
cluster runs (olah as the Hugging Face hub, SeaweedFS as S3): files arrive complete and verified,
a second run resumes, and every failure is one line naming the URI and the cause."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvpilot.contract.fetch import FetchError
from kvpilot.contract.model_source import HF_ALLOW_PATTERNS, parse_model_uri
from kvpilot.contract.remote_config import count_parameters, read_config_json
from tests.support.model_sources import (
    HF_REPO_ID,
    MODEL_DIR,
    S3_PREFIX,
    S3Endpoint,
    hf_env,
    s3_env,
    sha256_files,
)
from tests.support.server_process import RuntimeServer

pytestmark = pytest.mark.slow  # fetches from the dev cluster's model servers

MODEL_FILES = sha256_files(MODEL_DIR, list(HF_ALLOW_PATTERNS))  # eval.txt and README stay behind


def fetch(uri: str, dest: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvpilot.runtime.cli", "fetch", "--model", uri, "--to"]
    return subprocess.run(
        [*command, str(dest)], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def one_line_error(result: subprocess.CompletedProcess[str], uri: str) -> str:
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kvpilot-runtime fetch: {uri}: "), result.stderr
    assert "Traceback" not in result.stderr
    return last


@pytest.mark.parametrize("revision", ["", "@main"])
def test_hf_fetch_is_complete_verified_and_resumable(
    hf_endpoint: str, tmp_path: Path, revision: str
) -> None:
    uri, dest, env = (
        f"hf://{HF_REPO_ID}{revision}",
        tmp_path / "model",
        hf_env(hf_endpoint, tmp_path),
    )
    first = fetch(uri, dest, env)
    assert first.returncode == 0, first.stderr
    assert sha256_files(dest) == MODEL_FILES
    assert "verified" in first.stderr and f"fetched {uri}" in first.stderr  # progress in the log
    (dest / "model.safetensors").write_bytes(b"torn")  # a pod killed mid-download
    second = fetch(uri, dest, env)
    assert second.returncode == 0, second.stderr
    assert sha256_files(dest) == MODEL_FILES


def test_s3_fetch_is_complete_verified_and_resumable(
    s3_endpoint: S3Endpoint, tmp_path: Path
) -> None:
    uri, dest = f"s3://{s3_endpoint.bucket}/{S3_PREFIX}", tmp_path / "model"
    first = fetch(uri, dest, s3_env(s3_endpoint))
    assert first.returncode == 0, first.stderr
    assert sha256_files(dest, list(HF_ALLOW_PATTERNS)) == MODEL_FILES
    (dest / "config.json").write_text("{}")  # same name, wrong bytes: not complete
    (dest / "tokenizer.json").unlink()
    second = fetch(uri, dest, s3_env(s3_endpoint))
    assert second.returncode == 0, second.stderr
    assert "model.safetensors: already complete" in second.stderr
    assert sha256_files(dest, list(HF_ALLOW_PATTERNS)) == MODEL_FILES


def test_hf_failures_are_one_line(hf_endpoint: str, tmp_path: Path) -> None:
    env = hf_env(hf_endpoint, tmp_path)
    uri = "hf://kvpilot/no-such-model"
    assert "404 repository not found" in one_line_error(fetch(uri, tmp_path / "a", env), uri)
    unreachable = hf_env("http://127.0.0.1:9", tmp_path)  # the discard port: nothing listens
    uri = f"hf://{HF_REPO_ID}"
    line = one_line_error(fetch(uri, tmp_path / "b", unreachable), uri)
    assert "HF_ENDPOINT" in line


def test_s3_failures_are_one_line(s3_endpoint: S3Endpoint, tmp_path: Path) -> None:
    uri = f"s3://no-such-bucket/{S3_PREFIX}"
    line = one_line_error(fetch(uri, tmp_path / "a", s3_env(s3_endpoint)), uri)
    assert "404 bucket" in line
    uri = f"s3://{s3_endpoint.bucket}/{S3_PREFIX}"
    line = one_line_error(fetch(uri, tmp_path / "b", s3_env(s3_endpoint, secret="wrong")), uri)
    assert "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY" in line
    uri = f"s3://{s3_endpoint.bucket}/no-such-model"
    assert "no objects under" in one_line_error(
        fetch(uri, tmp_path / "c", s3_env(s3_endpoint)), uri
    )
    uri = "pvc://claim/model"
    assert "mounted into the pod" in one_line_error(
        fetch(uri, tmp_path / "d", os.environ.copy()), uri
    )


def test_config_json_and_parameters_are_read_without_the_weights(
    hf_endpoint: str, s3_endpoint: S3Endpoint, tmp_path: Path
) -> None:
    env = {**hf_env(hf_endpoint, tmp_path), **s3_env(s3_endpoint)}
    expected = json.loads((MODEL_DIR / "config.json").read_bytes())
    for uri in (f"hf://{HF_REPO_ID}", f"s3://{s3_endpoint.bucket}/{S3_PREFIX}"):
        source = parse_model_uri(uri)
        assert read_config_json(source, env) == expected, uri
        assert count_parameters(source, env) == 3_819_776, uri  # tiny-llama's README
    wrong = {**env, "AWS_SECRET_ACCESS_KEY": "wrong"}
    with pytest.raises(FetchError, match="check AWS_ACCESS_KEY_ID"):
        read_config_json(parse_model_uri(f"s3://{s3_endpoint.bucket}/{S3_PREFIX}"), wrong)


def test_serve_loads_an_hf_model_directly(
    hf_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in hf_env(hf_endpoint, tmp_path / "hf-home").items():
        monkeypatch.setenv(name, value)
    server = RuntimeServer(["--model", f"hf://{HF_REPO_ID}"], tmp_path / "serve.log")
    try:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        cached = list((tmp_path / "hf-home" / "hub").glob("models--kvpilot--tiny-llama"))
        assert cached, "served from the HF cache under HF_HOME"
    finally:
        assert server.stop() == 0
