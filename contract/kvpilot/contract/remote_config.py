"""A model's config.json and parameter count, read at the source without its weights.

The operator plans a model its catalog lacks from these (catalog.facts_from_config). Reads use
the environment given (the ModelDeployment's endpoints and Secret), never the process's own, so
one operator reads each model as that model's pods would. Failures are FetchErrors in one line.
"""

from __future__ import annotations

import json
import math
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpilot.contract.fetch import FetchError, explained
from kvpilot.contract.model_source import ModelSource

# A safetensors file starts with its header's length (u64, little-endian), then the header.
_HEADER_LEN = struct.Struct("<Q")


def read_config_json(source: ModelSource, env: Mapping[str, str]) -> dict[str, Any]:
    with explained(source):
        if source.scheme == "hf":
            from huggingface_hub import hf_hub_download

            with tempfile.TemporaryDirectory() as cache:  # nothing of the model is kept
                path = hf_hub_download(
                    source.location,
                    "config.json",
                    revision=source.revision,
                    token=env.get("HF_TOKEN") or None,
                    cache_dir=cache,
                    endpoint=env.get("HF_ENDPOINT") or None,
                )
                return dict(json.loads(Path(path).read_text()))
        if source.scheme == "s3":
            key = f"{source.path.rstrip('/')}/config.json"
            body = s3_client(env).get_object(Bucket=source.location, Key=key)["Body"].read()
            return dict(json.loads(body))
    raise FetchError(f"{source.uri}: config.json is read from hf:// and s3:// sources only")


def count_parameters(source: ModelSource, env: Mapping[str, str]) -> int:
    """Parameters in the safetensors files, from their headers (a few KiB per file)."""
    with explained(source):
        if source.scheme == "hf":
            from huggingface_hub import HfApi

            api = HfApi(endpoint=env.get("HF_ENDPOINT") or None, token=env.get("HF_TOKEN") or None)
            metadata = api.get_safetensors_metadata(source.location, revision=source.revision)
            return sum(metadata.parameter_count.values())
        if source.scheme == "s3":
            return _count_s3_parameters(source, s3_client(env))
    raise FetchError(f"{source.uri}: parameters are counted for hf:// and s3:// sources only")


def s3_client(env: Mapping[str, str]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=env.get("AWS_ENDPOINT_URL") or None,
        aws_access_key_id=env.get("AWS_ACCESS_KEY_ID") or None,
        aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY") or None,
        region_name=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
    )


def _count_s3_parameters(source: ModelSource, s3: Any) -> int:
    prefix = source.path.rstrip("/") + "/"
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=source.location, Prefix=prefix)
    keys = [
        o["Key"] for p in pages for o in p.get("Contents", []) if o["Key"].endswith(".safetensors")
    ]
    if not keys:
        raise FetchError(f"no .safetensors files under s3://{source.location}/{prefix}")
    return sum(safetensors_parameters(_s3_header(s3, source.location, key)) for key in keys)


def _s3_header(s3: Any, bucket: str, key: str) -> dict[str, Any]:
    def read(first: int, last: int) -> bytes:
        return bytes(
            s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={first}-{last}")["Body"].read()
        )

    (length,) = _HEADER_LEN.unpack(read(0, 7))
    return dict(json.loads(read(8, 8 + length - 1)))


def safetensors_parameters(header: Mapping[str, Any]) -> int:
    """Elements of every tensor a safetensors header lists (`__metadata__` is not a tensor)."""
    return sum(
        math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__"
    )
