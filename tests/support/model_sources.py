"""The model servers for tests, standalone in a temp dir: the same code `hack.devcluster up` runs.

`hf_hub(state_dir)` yields HF_ENDPOINT of an olah hub serving `kvpilot/tiny-llama`;
`s3_store(state_dir)` yields an S3Endpoint (endpoint_url, access_key, secret_key, bucket, region)
of a SeaweedFS store whose bucket `models` holds `tiny-llama/`. Both stop on exit; their data
stays in the temp dir. When KUBECONFIG names an existing cluster whose `env` was exported,
`existing_hf_endpoint` / `existing_s3_endpoint` return its servers instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from hack.devcluster import build, modelsources, procs
from hack.devcluster.modelsources import HF_REPO_ID, MODEL_DIR, S3_PREFIX, S3Endpoint
from hack.devcluster.versions import SEAWEEDFS

__all__ = [
    "HF_REPO_ID",
    "MODEL_DIR",
    "S3_PREFIX",
    "S3Endpoint",
    "existing_hf_endpoint",
    "existing_s3_endpoint",
    "hf_hub",
    "s3_store",
    "sha256_files",
]


def sha256_files(root: Path, patterns: list[str] | None = None) -> dict[str, str]:
    """relative path -> sha256 of each file under root (matching one of `patterns`, if given);
    huggingface_hub's .cache folder in a download dir is skipped. Compare with MODEL_DIR's."""
    files = [
        p for p in root.rglob("*") if p.is_file() and ".cache" not in p.relative_to(root).parts
    ]
    if patterns is not None:
        files = [p for p in files if any(p.match(pattern) for pattern in patterns)]
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files
    }


@contextlib.contextmanager
def hf_hub(state_dir: Path, port: int | None = None) -> Iterator[str]:
    try:
        yield modelsources.start_hf_hub(state_dir, port or procs.free_port())
    finally:
        modelsources.stop_hf_hub(state_dir)


@contextlib.contextmanager
def s3_store(state_dir: Path, port: int | None = None) -> Iterator[S3Endpoint]:
    build.ensure_built(SEAWEEDFS)  # once per machine, like the control plane (~6 min cold)
    try:
        yield modelsources.start_s3(state_dir, port or procs.free_port())
    finally:
        modelsources.stop_s3(state_dir)


def existing_hf_endpoint() -> str | None:
    """The hub of an existing cluster (`eval "$(python -m hack.devcluster env)"`), if any."""
    if os.environ.get("KUBECONFIG") and os.environ.get("HF_ENDPOINT"):
        return os.environ["HF_ENDPOINT"]
    return None


def existing_s3_endpoint() -> S3Endpoint | None:
    names = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    if not os.environ.get("KUBECONFIG") or not all(os.environ.get(n) for n in names):
        return None
    return S3Endpoint(
        endpoint_url=os.environ["AWS_ENDPOINT_URL"],
        access_key=os.environ["AWS_ACCESS_KEY_ID"],
        secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        bucket=modelsources.S3_BUCKET,
        region=os.environ.get("AWS_REGION", modelsources.S3_REGION),
    )


def hf_env(endpoint: str, home: Path) -> dict[str, str]:
    return {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_OFFLINE": "0"}


def s3_env(s3: S3Endpoint, secret: str | None = None) -> dict[str, str]:
    return {
        **os.environ,
        "AWS_ENDPOINT_URL": s3.endpoint_url,
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": secret or s3.secret_key,
        "AWS_REGION": s3.region,
    }
