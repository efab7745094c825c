"""LoRA adapters over HTTP, as vLLM serves them: a request names an adapter as its `model`,
/v1/models lists the adapters with `parent` (the base model's id) and `root` (where they were
read from), and /v1/load_lora_adapter and /v1/unload_lora_adapter change the set at run time
(present, as in vLLM, only when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true).

An adapter's path is a local directory, file://, hf://ORG/NAME[@REV] or s3://BUCKET/PREFIX,
fetched as the model is (contract/fetch.py), unless --lora-cache-dir holds it already (the
operator's model cache); or pvc://CLAIM/PATH, read where the operator mounts the claim
(--lora-claims CLAIM=DIR; contract/adapter_cache.py). Everything here reads files or the
network, so the server calls it off its event loop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvpilot.contract.adapter_cache import AdapterDirs, claim_path
from kvpilot.contract.fetch import FetchError, fetch
from kvpilot.contract.model_source import parse_model_uri
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.lora_registry import LoraNotFoundError
from kvpilot.runtime.engine.lora_slots import LoraRequest
from kvpilot.runtime.models.lora_files import LoraError
from kvpilot.runtime.server.errors import ApiError

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
NO_DIRS = AdapterDirs()


def runtime_updates_allowed(env: Mapping[str, str] = os.environ) -> bool:
    """vLLM's switch for the load/unload endpoints ("1" or "true", any case)."""
    return env.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


def local_adapter_dir(uri: str, dirs: AdapterDirs = NO_DIRS) -> str:
    """The adapter as a local directory: pvc:// under its claim's --lora-claims mount; hf://
    and s3:// from --lora-cache-dir's entry when it holds one, else fetched; ValueError naming
    the URI when it cannot be."""
    source = parse_model_uri(uri)
    if source.scheme == "pvc":
        return claim_path(dirs.claims, source)
    entry = dirs.cache_entry(uri) if source.is_fetched else None
    if entry is not None and os.path.isdir(entry):
        return entry  # fetched once into the shared cache by the operator's fill Job
    if source.is_fetched:
        return str(fetch(source, None).path)
    return source.location if source.scheme == "file" else uri


def load(
    core: Engine, base_name: str, name: str, uri: str, dirs: AdapterDirs = NO_DIRS
) -> LoraRequest:
    """Register adapter `name`; ApiError 400 naming the cause when it cannot be served."""
    if name == base_name:
        raise ApiError(
            400, f"lora_name {name!r} is the base model's name; choose another", "lora_name"
        )
    try:
        return core.load_lora(name, local_adapter_dir(uri, dirs), uri)
    except (LoraError, ValueError, FetchError) as exc:  # the adapter; its URI; its download
        raise ApiError(
            400, f"cannot load LoRA adapter {name!r} from {uri}: {exc}", "lora_path"
        ) from exc


def unload(core: Engine, name: str) -> None:
    try:
        core.unload_lora(name)
    except LoraNotFoundError as exc:
        raise ApiError(
            404, f"The lora adapter '{name}' cannot be found.", "lora_name", "NotFoundError"
        ) from exc


def lora_for(core: Engine, base_name: str, model: str | None) -> LoraRequest | None:
    """The adapter a request's `model` names (None: the base model); 404 model_not_found for
    a name that is neither."""
    if model is None or model == base_name:
        return None
    try:
        return core.lora_request(model)
    except LoraError as exc:  # evicted from host memory and unreadable on disk now
        raise ApiError(500, f"LoRA adapter {model!r} cannot be read again: {exc}") from exc
    except (LoraNotFoundError, ValueError) as exc:  # ValueError: LoRA is off
        raise model_not_found(model, base_name) from exc


def model_not_found(model: str, base_name: str) -> ApiError:
    return ApiError(
        404,
        f"model {model!r} is not served here; use {base_name!r} or a loaded LoRA adapter",
        "model",
        code="model_not_found",
    )


def is_served(core: Engine | None, model: str) -> bool:
    """Whether `model` names a loaded adapter."""
    return (
        core is not None and core.lora_registry is not None and core.lora_registry.is_loaded(model)
    )
