"""`kvpilot-runtime fetch --model URI --to DIR`: a model's files into a local directory.

What the operator's init container (and the model-cache Job) runs, and what `serve --model hf://…`
uses directly. hf:// goes through huggingface_hub (HF_ENDPOINT, HF_TOKEN, HF_HOME, HF_HUB_OFFLINE),
s3:// through boto3 (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY). A fetch is
resumable (files already complete are kept, partial ones resumed or redone) and verified (sizes,
and sha256 or MD5 where the source publishes them). Every failure is one line naming the URI and
the cause.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.contract.dataset_source import DatasetSource
from kvpilot.contract.model_source import HF_ALLOW_PATTERNS, ModelSource, parse_model_uri

Log = Callable[[str], None]
CHUNK = 1 << 20


class FetchError(Exception):
    """A fetch that cannot succeed as asked; the message is the whole story, in one line."""


@dataclass(frozen=True)
class FetchResult:
    path: Path
    num_files: int
    num_bytes: int
    seconds: float

    def summary(self) -> dict[str, float]:
        return {"files": self.num_files, "bytes": self.num_bytes, "seconds": round(self.seconds, 3)}


def log_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def fetch(source: ModelSource, dest: Path | None, log: Log = log_line) -> FetchResult:
    """The model in `dest` (None: hf:// into the HF cache, s3:// into HF_HOME/kvpilot-s3)."""
    started = time.monotonic()
    with explained(source):
        if source.scheme == "hf":
            path = _fetch_hf(source, dest, log)
        elif source.scheme == "s3":
            path = _fetch_s3(source, dest or _s3_cache_dir(source), log)
        elif source.scheme == "file":
            path = _copy_local(source, dest, log)
        else:
            raise FetchError(
                "pvc:// models are mounted into the pod, not fetched; use hf://, s3:// or file://"
            )
    files = [p for p in path.rglob("*") if p.is_file() and ".cache" not in p.parts]
    num_bytes = sum(p.stat().st_size for p in files)
    result = FetchResult(path, len(files), num_bytes, time.monotonic() - started)
    log(
        f"fetched {source.uri}: {result.num_files} files, {num_bytes / 2**20:.1f} MiB in "
        f"{result.seconds:.1f} s -> {path}"
    )
    return result


# -- hf:// -------------------------------------------------------------------------------------


def _hf_token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int | None
    sha256: str | None  # the hub publishes it for LFS files (the weights)


def _fetch_hf(source: ModelSource, dest: Path | None, log: Log) -> Path:
    from huggingface_hub import constants, snapshot_download

    where = f"into {dest}" if dest else "into the Hugging Face cache"
    log(f"fetching {source.uri} from {constants.ENDPOINT} {where}")
    offline = constants.HF_HUB_OFFLINE
    revision, remote = (source.revision, []) if offline else _hf_listing(source)
    if dest is not None:
        _drop_torn_files(dest, remote, log)  # snapshot_download trusts what is there
    path = Path(
        snapshot_download(
            source.location,
            revision=revision,
            allow_patterns=list(HF_ALLOW_PATTERNS),
            local_dir=dest,
            token=_hf_token(),
        )
    )
    if offline:
        log("HF_HUB_OFFLINE=1: files taken from the local cache, not checked against the hub")
    else:
        _verify(path, remote, log)
    return path


def _hf_listing(source: ModelSource) -> tuple[str | None, list[RemoteFile]]:
    """The commit a revision names and the files to fetch there, with sizes and sha256s."""
    from fnmatch import fnmatch

    from huggingface_hub import HfApi, RepoFile

    api, token = HfApi(), _hf_token()
    # "main" named: mirrors answer only /api/models/<repo>/revision/<rev>
    info = api.model_info(source.location, revision=source.revision or "main", token=token)
    names = [
        s.rfilename
        for s in info.siblings or []
        if any(fnmatch(s.rfilename, pattern) for pattern in HF_ALLOW_PATTERNS)
    ]
    entries = api.get_paths_info(
        source.location, names, expand=True, revision=info.sha, token=token
    )
    files = [
        RemoteFile(e.path, e.size, e.lfs.sha256 if e.lfs else None)
        for e in entries
        if isinstance(e, RepoFile)
    ]
    return info.sha, files


def _drop_torn_files(dest: Path, remote: list[RemoteFile], log: Log) -> None:
    for file in remote:
        local = dest / file.name
        if local.is_file() and file.size is not None and local.stat().st_size != file.size:
            log(f"  {file.name}: {local.stat().st_size} of {file.size} bytes, fetching again")
            local.unlink()


def _verify(path: Path, remote: list[RemoteFile], log: Log) -> None:
    """Sizes of every file, sha256 where the source publishes one."""
    for file in remote:
        local = path / file.name
        if file.size is not None and local.stat().st_size != file.size:
            raise FetchError(f"{file.name}: {local.stat().st_size} bytes, expected {file.size}")
        if file.sha256 is not None and _sha256(local) != file.sha256:
            raise FetchError(f"{file.name}: sha256 differs from the source's")
    num_hashed = sum(f.sha256 is not None for f in remote)
    log(f"verified {len(remote)} files: sizes, and sha256 of {num_hashed}")


# -- s3:// -------------------------------------------------------------------------------------


def _s3_client() -> Any:
    import boto3  # reads AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY itself

    return boto3.client("s3")


def _s3_cache_dir(source: ModelSource) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "kvpilot-s3" / source.location / source.path


def _fetch_s3(source: ModelSource, dest: Path, log: Log) -> Path:
    s3 = _s3_client()
    prefix = source.path.rstrip("/") + "/"
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=source.location, Prefix=prefix)
    objects = [o for page in pages for o in page.get("Contents", []) if not o["Key"].endswith("/")]
    if not objects:
        raise FetchError(f"no objects under s3://{source.location}/{prefix}")
    total = sum(o["Size"] for o in objects)
    log(f"fetching {source.uri} ({len(objects)} files, {total / 2**20:.1f} MiB) into {dest}")
    for obj in objects:
        target = dest / obj["Key"][len(prefix) :]
        if _is_complete(target, obj):
            log(f"  {target.name}: already complete")
            continue
        _download_s3_object(s3, source.location, obj, target)
        log(f"  {target.name}: {obj['Size'] / 2**20:.1f} MiB")
    return dest


def _download_s3_object(s3: Any, bucket: str, obj: dict[str, Any], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".incomplete")
    s3.download_file(bucket, obj["Key"], str(partial))
    if not _is_complete(partial, obj):
        raise FetchError(f"{obj['Key']}: downloaded file does not match its size or ETag")
    partial.replace(target)


def _is_complete(path: Path, obj: dict[str, Any]) -> bool:
    """Same size, and same MD5 where the ETag is one (a multipart upload's ETag is not)."""
    if not path.is_file() or path.stat().st_size != obj["Size"]:
        return False
    etag = str(obj.get("ETag", "")).strip('"')
    return "-" in etag or len(etag) != 32 or _digest(path, hashlib.md5()) == etag


# -- one dataset file -------------------------------------------------------------------------


def fetch_dataset(source: DatasetSource, dest: Path) -> Path:
    """An eval set's file into `dest` (hf://, s3://), or its local path (file://). pvc:// is
    mounted by the operator's eval Job, which passes the mounted path instead."""
    with explained(source):
        if source.scheme == "hf":
            from huggingface_hub import hf_hub_download

            return Path(
                hf_hub_download(
                    source.location,
                    source.path,
                    repo_type=source.repo_type,
                    revision=source.revision,
                    local_dir=dest,
                    token=_hf_token(),
                )
            )
        if source.scheme == "s3":
            target = dest / source.file_name
            _s3_client().download_file(source.location, source.path, str(target))
            return target
        if source.scheme == "file":
            return Path(source.location)
        raise FetchError("pvc:// datasets are mounted into the eval Job: pass the mounted path")


# -- file:// -----------------------------------------------------------------------------------


def _copy_local(source: ModelSource, dest: Path | None, log: Log) -> Path:
    origin = Path(source.location)
    if not origin.is_dir():
        raise FetchError(f"{origin} is not a directory")
    if dest is None or dest.resolve() == origin.resolve():
        return origin
    log(f"copying {origin} into {dest}")
    shutil.copytree(origin, dest, dirs_exist_ok=True)
    return dest


# -- helpers -----------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    return _digest(path, hashlib.sha256())


def _digest(path: Path, hasher: Any) -> str:
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
    return str(hasher.hexdigest())


@contextmanager
def explained(source: ModelSource | DatasetSource) -> Iterator[None]:
    """Library exceptions -> FetchError('URI: cause; what to do'), one line."""
    try:
        yield
    except FetchError as err:
        raise FetchError(f"{source.uri}: {err}") from err
    except Exception as err:
        cause = explain(err)
        if cause is None:
            raise
        raise FetchError(f"{source.uri}: {cause}") from err


def explain(err: Exception) -> str | None:
    """A known failure of huggingface_hub or boto3 as a cause and a remedy; None if unknown."""
    return _explain_hf(err) or _explain_s3(err) or _explain_network(err)


def _explain_hf(err: Exception) -> str | None:
    try:
        from huggingface_hub import errors
    except ImportError:
        return None
    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, errors.GatedRepoError):
        return "403 gated repository: accept its terms on the hub with the account of HF_TOKEN"
    if isinstance(err, errors.RevisionNotFoundError):
        return "404 revision not found: check the @REVISION (branch, tag or commit)"
    if isinstance(err, errors.RepositoryNotFoundError):
        return (
            "404 repository not found, or private and HF_TOKEN cannot see it: check ORG/NAME "
            "and the token in the Secret named by spec.model.secretRef"
        )
    if isinstance(err, errors.LocalEntryNotFoundError):
        return (
            "not in the local cache, and the hub is offline or unreachable "
            "(check HF_HUB_OFFLINE and HF_ENDPOINT)"
        )
    if isinstance(err, errors.EntryNotFoundError):
        return "404 file not found in the repository: is it an HF-format checkpoint?"
    if isinstance(err, errors.HfHubHTTPError) and status in (401, 403):
        return (
            f"{status} token rejected: check HF_TOKEN in the Secret named by spec.model.secretRef"
        )
    if isinstance(err, errors.HfHubHTTPError):
        return f"HTTP {status} from the hub: {str(err).splitlines()[0]}"
    return None


def _explain_s3(err: Exception) -> str | None:
    try:
        from botocore import exceptions
    except ImportError:
        return None
    if isinstance(err, exceptions.NoCredentialsError):
        return "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (the Secret)"
    if isinstance(err, exceptions.EndpointConnectionError):
        return f"cannot reach the S3 endpoint ({err}): check AWS_ENDPOINT_URL and the network"
    if not isinstance(err, exceptions.ClientError):
        return None
    code = err.response.get("Error", {}).get("Code", "")
    if code in ("NoSuchBucket", "404"):
        return "404 bucket or key not found: check the BUCKET/PREFIX"
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
        return f"{code}: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the Secret"
    return f"S3 error {code}: {err}"


def _explain_network(err: Exception) -> str | None:
    if isinstance(err, (*_transport_errors(), ConnectionError, TimeoutError)):
        return f"network error ({type(err).__name__}: {err}): check HF_ENDPOINT / AWS_ENDPOINT_URL"
    return None


def _transport_errors() -> tuple[type[Exception], ...]:
    """httpx's and httpx2's (huggingface_hub 2 uses the latter) connection-level errors."""
    found: list[type[Exception]] = []
    for module in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(module).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvpilot-runtime fetch", description="Fetch a model into a local directory."
    )
    parser.add_argument("--model", required=True, help="hf://ORG/NAME[@REV], s3://BUCKET/PREFIX")
    parser.add_argument("--to", required=True, type=Path, help="directory to fill")
    parser.add_argument(
        "--summary-file",
        type=Path,
        help="write what was fetched there as JSON (files, bytes, seconds); a cache-filling Job"
        " points it at its termination log, so the operator can report it in status",
    )
    args = parser.parse_args(argv)
    try:
        result = fetch(parse_model_uri(args.model), args.to)
    except (FetchError, ValueError) as err:
        print(f"kvpilot-runtime fetch: {err}", file=sys.stderr)
        return 1
    if args.summary_file is not None:
        args.summary_file.write_text(json.dumps(result.summary()))
    return 0
