"""Where the dev cluster's models come from, served the way a real cluster reaches them.

- A Hugging Face hub: olah (a self-hosted Hub mirror, PyPI) in offline mode, serving a local git
  mirror of models/tiny-llama as repo `kvpilot/tiny-llama`; huggingface_hub talks to it through
  HF_ENDPOINT exactly as it talks to huggingface.co.
- An S3 store: SeaweedFS (`weed server -s3`, built from Go modules like the control plane) with one
  static identity, bucket `models` holding `tiny-llama/`, uploaded with boto3.

One implementation: `DevCluster.up` starts both beside the control plane, and tests start them
standalone in a temp dir (tests/support/model_sources.py), through `start_hf_hub` / `start_s3`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hack.devcluster import procs
from hack.devcluster.errors import DevClusterError
from hack.devcluster.versions import REPO_ROOT, SEAWEEDFS

MODEL_DIR = REPO_ROOT / "models" / "tiny-llama"
HF_REPO_ID = "kvpilot/tiny-llama"
S3_BUCKET = "models"
S3_PREFIX = "tiny-llama/"
# boto3 signs with a region; SeaweedFS accepts any, so we use the SDK's default one.
S3_REGION = "us-east-1"
# Fixed dev credentials, like the dev PKI: both servers listen on loopback only.
S3_ACCESS_KEY = "kvpilot-dev"
S3_SECRET_KEY = "kvpilot-dev-secret-key"
HF_PROCESS = "hf-hub"
S3_PROCESS = "seaweedfs"
START_TIMEOUT_S = 120.0
# Fixed identity and dates make the mirror's commit sha the same on every machine; no user or
# system config (hooks, autocrlf, signing) takes part.
GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "kvpilot",
    "GIT_AUTHOR_EMAIL": "dev@kvpilot.dev",
    "GIT_COMMITTER_NAME": "kvpilot",
    "GIT_COMMITTER_EMAIL": "dev@kvpilot.dev",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
}


@dataclass(frozen=True)
class S3Endpoint:
    """What a client needs to read the model store (the `s3_endpoint` test fixture)."""

    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = S3_REGION


def hf_endpoint(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def s3_endpoint(port: int) -> S3Endpoint:
    return S3Endpoint(f"http://127.0.0.1:{port}", S3_ACCESS_KEY, S3_SECRET_KEY, S3_BUCKET)


def client_env(hf_port: int, s3_port: int) -> dict[str, str]:
    """The variables huggingface_hub and boto3 read to reach these servers."""
    s3 = s3_endpoint(s3_port)
    return {
        "HF_ENDPOINT": hf_endpoint(hf_port),
        "AWS_ENDPOINT_URL": s3.endpoint_url,
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
        "AWS_REGION": s3.region,
    }


def require_module(name: str, what: str) -> None:
    if importlib.util.find_spec(name) is None:
        raise DevClusterError(
            f"{what} needs the Python package {name}, missing from this virtualenv:"
            " run `make setup` (pyproject.toml lists it)"
        )


# -- Hugging Face hub (olah) -------------------------------------------------------------------


def build_olah_config(port: int, cache_dir: Path, mirrors_dir: Path) -> dict[str, Any]:
    """olah's TOML config: offline (never calls huggingface.co), serving the local git mirrors."""
    return {
        "basic": {
            "host": "127.0.0.1",
            "port": port,
            "repos-path": str(cache_dir),
            "mirrors-path": [str(mirrors_dir)],
        },
        "accessibility": {"offline": True},
    }


def olah_argv(config_file: Path, log_dir: Path) -> list[str]:
    # --log-path: olah writes ./logs by default, which would land in the repo root.
    return [sys.executable, "-m", "olah.server", "-c", str(config_file), "--log-path", str(log_dir)]


def make_hf_mirror(model_dir: Path, mirrors_dir: Path, repo_id: str) -> str:
    """A git repo of `model_dir` where olah looks for `repo_id`; returns its commit sha."""
    repo = mirrors_dir / "models" / repo_id
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(model_dir, repo)
    env = {**os.environ, **GIT_ENV}
    for argv in (
        ["git", "init", "-q", "-b", "main"],
        ["git", "add", "-A"],
        ["git", "commit", "-q", "--no-gpg-sign", "-m", f"{repo_id} from {model_dir.name}"],
    ):
        subprocess.run(argv, cwd=repo, env=env, check=True, capture_output=True)
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


def start_hf_hub(state_dir: Path, port: int) -> str:
    """Serve models/tiny-llama as `kvpilot/tiny-llama` on `port` (once); returns HF_ENDPOINT."""
    require_module("olah", "the Hugging Face hub")
    import toml  # olah's own dependency: it reads this config with it

    run_dir, log_dir = state_dir / "run", state_dir / "logs"
    url = hf_endpoint(port)
    if procs.is_running(run_dir, HF_PROCESS):
        return url
    procs.require_port_free(port, "the Hugging Face hub (olah)")
    mirrors, config_file = state_dir / "hf-mirrors", state_dir / "olah.toml"
    make_hf_mirror(MODEL_DIR, mirrors, HF_REPO_ID)
    config_file.write_text(toml.dumps(build_olah_config(port, state_dir / "hf-cache", mirrors)))
    argv = olah_argv(config_file, log_dir / "olah")
    proc = procs.start(HF_PROCESS, argv, run_dir, log_dir)
    ready = f"{url}/api/models/{HF_REPO_ID}/revision/main"
    procs.wait_healthy(proc, ready, log_dir / f"{HF_PROCESS}.log", START_TIMEOUT_S)
    return url


# -- S3 (SeaweedFS) ----------------------------------------------------------------------------


def build_s3_identities(access_key: str, secret_key: str) -> dict[str, Any]:
    """`weed -s3.config`: one identity; requests without its signature are refused."""
    return {
        "identities": [
            {
                "name": "kvpilot-dev",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }


def weed_argv(data_dir: Path, s3_config: Path, s3_port: int, internal: list[int]) -> list[str]:
    """`weed server -s3` (master, volume, filer and S3 gateway in one process) on loopback.

    Every port is explicit: a gRPC port left at 0 is the HTTP port + 10000, which may be taken.
    """
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3_grpc = internal
    return [
        str(SEAWEEDFS.path("weed")),
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data_dir}",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        "-master.volumeSizeLimitMB=64",
        "-master.telemetry=false",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        "-volume.max=8",
        "-filer",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        "-s3",
        f"-s3.port={s3_port}",
        f"-s3.port.grpc={s3_grpc}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={s3_config}",
    ]


def start_s3(state_dir: Path, port: int) -> S3Endpoint:
    """Serve bucket `models` holding `tiny-llama/` on `port` (once); returns the endpoint."""
    run_dir, log_dir = state_dir / "run", state_dir / "logs"
    endpoint = s3_endpoint(port)
    if procs.is_running(run_dir, S3_PROCESS):
        return endpoint
    procs.require_port_free(port, "the S3 store (SeaweedFS)")
    require_module("boto3", "seeding the S3 store")
    data_dir, s3_config = state_dir / "seaweedfs-data", state_dir / "s3-identities.json"
    data_dir.mkdir(parents=True, exist_ok=True)
    s3_config.write_text(json.dumps(build_s3_identities(S3_ACCESS_KEY, S3_SECRET_KEY)))
    internal = procs.free_ports(7, taken={port})
    (state_dir / "seaweedfs-ports.json").write_text(json.dumps([port, *internal]))
    proc = procs.start(S3_PROCESS, weed_argv(data_dir, s3_config, port, internal), run_dir, log_dir)
    log = log_dir / f"{S3_PROCESS}.log"
    procs.wait_healthy(proc, f"{endpoint.endpoint_url}/healthz", log, START_TIMEOUT_S)
    seed_bucket(endpoint, MODEL_DIR, S3_PREFIX, log)
    return endpoint


def s3_client(endpoint: S3Endpoint) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint.endpoint_url,
        aws_access_key_id=endpoint.access_key,
        aws_secret_access_key=endpoint.secret_key,
        region_name=endpoint.region,
    )


def seed_bucket(endpoint: S3Endpoint, model_dir: Path, prefix: str, log: Path) -> None:
    """Create the bucket and upload the model; retried while the filer is still starting."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = s3_client(endpoint)
    errors: list[Exception] = []

    def try_seed() -> bool:
        try:
            upload_model(client, endpoint.bucket, model_dir, prefix)
            return True
        except (BotoCoreError, ClientError) as err:
            errors.append(err)
            return False

    if not procs.wait_for(try_seed, START_TIMEOUT_S, interval_s=1.0):
        raise DevClusterError(f"could not seed s3://{endpoint.bucket}/{prefix}: {errors[-1]}", log)


def upload_model(client: Any, bucket: str, model_dir: Path, prefix: str) -> None:
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        client.create_bucket(Bucket=bucket)
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, prefix + path.relative_to(model_dir).as_posix())


def stop_hf_hub(state_dir: Path) -> None:
    procs.stop(state_dir / "run", HF_PROCESS)


def stop_s3(state_dir: Path) -> None:
    """Stop weed and remove the unix sockets it leaves in /tmp (named by its ports)."""
    procs.stop(state_dir / "run", S3_PROCESS)
    saved = state_dir / "seaweedfs-ports.json"
    if saved.exists():
        for port in json.loads(saved.read_text()):
            for sock in Path("/tmp").glob(f"seaweedfs-*-{int(port)}.sock"):
                sock.unlink(missing_ok=True)
        saved.unlink()


def stop(state_dir: Path) -> None:
    """Stop both servers and drop their data (the next start seeds them anew)."""
    stop_hf_hub(state_dir)
    stop_s3(state_dir)
    for data in ("seaweedfs-data", "hf-mirrors", "hf-cache"):
        shutil.rmtree(state_dir / data, ignore_errors=True)
