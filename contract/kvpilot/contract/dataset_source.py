"""Eval dataset URIs (`hf://`, `s3://`, `pvc://`, `file://`, plain paths) parsed into one value.

Pure: the operator checks spec.quantization.evaluation.dataset.uri with it and decides how an
eval Job reaches the file (mounted or fetched); `kvpilot-runtime eval --dataset URI` fetches it
(fetch.fetch_dataset). A dataset is one file, so unlike a model URI every form names a file:

- hf://ORG/NAME[@REVISION]/PATH: a file of a model repo; hf://datasets/ORG/NAME[@REVISION]/PATH:
  of a dataset repo (huggingface_hub's own `hf://` convention).
- s3://BUCKET/KEY, pvc://CLAIM/PATH, file:///PATH or a plain path.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from kvpilot.contract.model_source import parse_model_uri

SCHEMES = ("hf", "s3", "pvc", "file")
FETCHED_SCHEMES = ("hf", "s3")
HF_DATASETS = "datasets/"
EXPECTED = (
    "use hf://ORG/NAME[@REVISION]/PATH, hf://datasets/ORG/NAME[@REVISION]/PATH, s3://BUCKET/KEY,"
    " pvc://CLAIM/PATH, file:///PATH or a local path"
)


@dataclass(frozen=True)
class DatasetSource:
    """`location`: the repo id, bucket, claim or local path; `path`: the file in it (hf, s3 key,
    pvc); `revision`: a branch, tag or commit (hf); `repo_type`: model or dataset (hf)."""

    uri: str
    scheme: str
    location: str
    path: str = ""
    revision: str | None = None
    repo_type: str = "model"

    @property
    def is_fetched(self) -> bool:
        return self.scheme in FETCHED_SCHEMES

    @property
    def file_name(self) -> str:
        """The file's own name: what the eval reads its format from (.jsonl or text)."""
        return (self.path or self.location).rstrip("/").rsplit("/", 1)[-1]


def parse_dataset_uri(uri: str) -> DatasetSource:
    """Split and check a dataset URI; ValueError naming the URI, the cause and the forms."""
    scheme = urlparse(uri).scheme
    if scheme == "" or len(scheme) == 1:  # a plain path (len 1: a Windows drive letter)
        return DatasetSource(uri, "file", uri)
    if scheme not in SCHEMES:
        raise ValueError(f"dataset URI {uri!r}: unknown scheme {scheme}://; {EXPECTED}")
    if scheme == "file":
        return _checked(uri, DatasetSource(uri, "file", unquote(urlparse(uri).path)))
    rest = uri[len(scheme) + 3 :]
    if scheme == "hf":
        return _checked(uri, _hf(uri, rest))
    head, _, tail = rest.partition("/")
    return _checked(uri, DatasetSource(uri, scheme, head, path=tail))


def _hf(uri: str, rest: str) -> DatasetSource:
    repo_type = "dataset" if rest.startswith(HF_DATASETS) else "model"
    rest = rest.removeprefix(HF_DATASETS)
    org, _, rest = rest.partition("/")
    name, _, path = rest.partition("/")
    name, _, revision = name.partition("@")
    return DatasetSource(uri, "hf", f"{org}/{name}", path, revision or None, repo_type)


def _checked(uri: str, source: DatasetSource) -> DatasetSource:
    names_no_file = not source.path or source.path.endswith("/")
    if source.scheme == "pvc" and names_no_file:
        raise ValueError(f"dataset URI {uri!r}: expected pvc://CLAIM/PATH naming the file")
    if source.scheme in ("hf", "s3") and names_no_file:
        raise ValueError(f"dataset URI {uri!r}: name the file in the repo or bucket; {EXPECTED}")
    if source.scheme == "file" and not source.location:
        raise ValueError(f"dataset URI {uri!r}: expected file:///ABSOLUTE/PATH")
    # The repo, bucket and claim follow a model URI's rules: its checks, its messages.
    if source.scheme == "hf":
        _as_model(uri, f"hf://{source.location}")
    elif source.scheme in ("s3", "pvc"):
        _as_model(uri, f"{source.scheme}://{source.location}/{source.path}")
    return source


def _as_model(uri: str, model_uri: str) -> None:
    try:
        parse_model_uri(model_uri)
    except ValueError as error:
        cause = str(error).split(": ", 1)[-1]
        raise ValueError(f"dataset URI {uri!r}: {cause}") from error
