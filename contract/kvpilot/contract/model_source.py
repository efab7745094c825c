"""Model URIs (`hf://`, `s3://`, `pvc://`, `file://`, plain paths) parsed into one value.

Pure: the operator uses it to decide how a pod gets its model (mounted or fetched by an init
container), the runtime to decide how `--model` becomes a local directory (contract/fetch.py does
I/O).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import unquote, urlparse

SCHEMES = ("hf", "s3", "pvc", "file")
FETCHED_SCHEMES = ("hf", "s3")  # copied into the pod's model volume by `kvpilot-runtime fetch`
# What a checkpoint needs: weights, configs, tokenizer; not the repo's other files (a GGUF or a
# second copy as .bin/.pt would double the download).
HF_ALLOW_PATTERNS = (
    "*.safetensors",
    "adapter_config.json",  # a PEFT LoRA adapter's (the runtime's --lora-modules)
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "chat_template.jinja",
)
_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class ModelSource:
    """`scheme` is one of SCHEMES; `location` is the repo id, bucket, claim or local path;
    `path` the key prefix (s3) or sub-path (pvc); `revision` a branch, tag or commit (hf)."""

    uri: str
    scheme: str
    location: str
    path: str = ""
    revision: str | None = None

    @property
    def is_fetched(self) -> bool:
        return self.scheme in FETCHED_SCHEMES

    @property
    def name(self) -> str:
        """The last path segment: the default served model name."""
        tail = self.path or self.location
        return PurePosixPath(tail.rstrip("/")).name or self.location


def parse_model_uri(uri: str) -> ModelSource:
    """Split and check a model URI; ValueError with the URI, the cause and the expected form."""
    parsed = urlparse(uri)
    scheme = parsed.scheme
    if scheme == "" or len(scheme) == 1:  # a plain path (len 1: a Windows drive letter)
        return _checked(uri, ModelSource(uri, "file", uri))
    if scheme not in SCHEMES:
        raise ValueError(
            f"model URI {uri!r}: unknown scheme {scheme}://; use hf://ORG/NAME[@REVISION], "
            "s3://BUCKET/PREFIX, pvc://CLAIM/PATH, file:///PATH or a local path"
        )
    if scheme == "file":
        return _checked(uri, ModelSource(uri, "file", unquote(parsed.path)))
    rest = uri[len(scheme) + 3 :].strip("/")
    if scheme == "hf":
        repo, _, revision = rest.partition("@")
        return _checked(uri, ModelSource(uri, "hf", repo, revision=revision or None))
    head, _, tail = rest.partition("/")
    return _checked(uri, ModelSource(uri, scheme, head, path=tail.strip("/")))


def _checked(uri: str, source: ModelSource) -> ModelSource:
    problem = _problem(source)
    if problem:
        raise ValueError(f"model URI {uri!r}: {problem}")
    return source


def _problem(source: ModelSource) -> str | None:
    if source.scheme == "hf" and not _HF_REPO.match(source.location):
        return "expected hf://ORG/NAME or hf://ORG/NAME@REVISION"
    if source.scheme == "s3" and not _S3_BUCKET.match(source.location):
        return "expected s3://BUCKET/PREFIX with a valid bucket name"
    if source.scheme == "s3" and not source.path:
        return "expected s3://BUCKET/PREFIX: name the folder that holds the checkpoint"
    if source.scheme == "pvc" and not _CLAIM.match(source.location):
        return "expected pvc://CLAIM/PATH with a valid PersistentVolumeClaim name"
    if source.scheme == "file" and not source.location:
        return "expected file:///ABSOLUTE/PATH"
    return None
