"""`kvpilot-runtime serve` flags: one frozen `ServeConfig` is the schema, the parser is derived.

`ServeConfig` is the engine's `EngineConfig` plus the server's own fields. Every field is a flag
named after it (`max_num_seqs` -> `--max-num-seqs`, vLLM's names where they overlap), so the
runtime's parser and the operator's pod args (`to_args`, called by operator/manifests.py) come
from the same fields and cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvpilot.contract.adapter_cache import AdapterDirs, parse_claims
from kvpilot.contract.engine_config import EngineConfig, option
from kvpilot.contract.model_source import ModelSource, parse_model_uri

# tool_calls.PARSERS' names, and auto (the architecture's own format)
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # logging's, and uvicorn's
# vLLM's switch for POST /v1/load_lora_adapter and /v1/unload_lora_adapter ("true" or "1"): the
# operator sets it in pods whose adapters it changes at run time.
LORA_RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class ServeConfig(EngineConfig):
    # The URI as given: a local directory, or hf:// / s3:// fetched when the model loads.
    model: str = field(
        metadata={
            "help": "local path, file:///PATH, hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX"
        }
    )
    served_name: str = option("", "model id clients send (default: the model's name)")
    host: str = option("0.0.0.0", "address to listen on")
    port: int = option(8000, "port to listen on")
    max_waiting: int = option(256, "queued sequences (prompts x n of each request) before 429")
    # A request's sequences are admitted together; one larger than this would hold the queue
    # alone (everyone else 429) for as long as it runs, so it is refused (400) instead.
    max_seqs_per_request: int = option(
        256,
        "most sequences (prompts x n) one request may ask for; larger requests are refused with "
        "400 (also capped at --max-num-seqs + --max-waiting, what the server can hold)",
    )
    api_key: str | None = option(
        None, "require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize"
    )
    shutdown_timeout: float = option(30.0, "drain time on SIGTERM, seconds")
    # uvicorn has no body timeout: a stalled upload would hold its connection for ever.
    request_body_timeout: float = option(
        60.0,
        "seconds a request body may take to arrive, from its headers to its last byte; slower "
        "uploads are answered 408 and their connection closed",
    )
    log_level: str = option("info", "logging threshold", LOG_LEVELS)
    threads: int | None = option(
        None,
        "torch intra-op threads (default: OMP_NUM_THREADS if set, else the cores this process "
        "may use: its cgroup CPU quota, or the CPUs it may run on)",
    )
    tool_call_parser: str = option(
        "auto",
        "format of the model's tool calls (auto: from the architecture: Llama llama3_json, "
        "Qwen/Mistral hermes)",
        TOOL_CALL_PARSERS,
    )
    # 16 MiB: a prompt that fills a 128k-token context is ~0.5-1 MB of text (or ~1 MB of token
    # ids as JSON), so 16x that leaves room for long chats and 128k+ contexts, while one request
    # can hold at most 16 MiB (plus its parsed copy) in memory: max_waiting of them stay < 10 GB.
    max_request_body_bytes: int = option(
        16 * 2**20, "largest request body in bytes; larger bodies are refused with 413"
    )
    lora_modules: tuple[str, ...] = option(
        (),
        "LoRA adapters loaded at start (with --enable-lora), each NAME=PATH or vLLM's JSON "
        '{"name": NAME, "path": PATH}; PATH a local PEFT adapter directory',
    )
    # Set by the operator (adapter_cache.py says how an entry and a claim's path are named).
    lora_cache_dir: str | None = option(
        None,
        "a directory of adapters fetched ahead, one per URI (the operator's model cache): an "
        "hf:// or s3:// adapter found there is read from it instead of fetched",
    )
    lora_claims: tuple[str, ...] = option(
        (),
        "where pvc:// adapters' claims are mounted, each CLAIM=DIR: pvc://CLAIM/PATH is read "
        "from DIR/PATH (a claim not listed: the adapter is refused)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = [
            (1 <= self.port <= 65535, f"port must be in 1..65535, got {self.port}"),
            (self.max_waiting >= 0, f"max_waiting must be >= 0, got {self.max_waiting}"),
            (
                self.max_seqs_per_request >= 1,
                f"max_seqs_per_request must be >= 1, got {self.max_seqs_per_request}",
            ),
            (self.shutdown_timeout >= 0, "shutdown_timeout must be >= 0"),
            (
                self.request_body_timeout > 0,
                f"request_body_timeout must be > 0, got {self.request_body_timeout}",
            ),
            (self.api_key is None or self.api_key != "", "api_key must not be empty"),
            (self.served_name != "", "served_name must not be empty"),
            (
                self.threads is None or self.threads >= 1,
                f"threads must be >= 1, got {self.threads}",
            ),
            (
                self.tool_call_parser in TOOL_CALL_PARSERS,
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}",
            ),
            (
                self.max_request_body_bytes >= 1024,
                f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self._check_lora_modules()
        parse_claims(self.lora_claims)  # ValueError naming a malformed one

    def _check_lora_modules(self) -> None:
        names = [name for name, _ in self.lora_adapters]
        if names and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names must be unique, got {names}")
        if self.served_name in names:
            raise ValueError(
                f"--lora-modules name {self.served_name!r} is the base model's served name; "
                "give the adapter another name"
            )

    @property
    def lora_adapters(self) -> list[tuple[str, str]]:
        """--lora-modules as (name, path) pairs."""
        return [parse_lora_module(text) for text in self.lora_modules]

    @property
    def adapter_dirs(self) -> AdapterDirs:
        return AdapterDirs(self.lora_cache_dir, parse_claims(self.lora_claims))

    @property
    def request_seq_limit(self) -> int:
        """The most sequences one request may hold: the flag, and never more than the server
        admits at once (every batch slot and the whole queue)."""
        return min(self.max_seqs_per_request, self.max_num_seqs + self.max_waiting)

    @property
    def source(self) -> ModelSource:
        return parse_model_uri(self.model)


def parse_lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules value, NAME=PATH or vLLM's JSON {"name": .., "path": ..} (its
    optional "base_model_name" is accepted: a server has one base model) -> (name, path)."""
    expected = 'expected NAME=PATH or {"name": NAME, "path": PATH}'
    if not text.lstrip().startswith("{"):
        name, sep, path = text.partition("=")
        if not (sep and name and path):
            raise ValueError(f"--lora-modules {text!r}: {expected}")
        return name, path
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--lora-modules {text!r} is not valid JSON ({exc}): {expected}") from exc
    unknown = set(data) - {"name", "path", "base_model_name"}
    if unknown:
        raise ValueError(f"--lora-modules {text!r}: unknown keys {sorted(unknown)}; {expected}")
    if not (isinstance(data.get("name"), str) and isinstance(data.get("path"), str)):
        raise ValueError(f"--lora-modules {text!r}: {expected}")
    return data["name"], data["path"]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(f: Field[Any]) -> type:
    """int for `int | None`, str for `str`, …: the type argparse converts a flag's text to."""
    hint = typing.get_type_hints(ServeConfig)[f.name]
    if isinstance(hint, types.UnionType):
        return next(t for t in typing.get_args(hint) if t is not type(None))
    return typing.cast(type, typing.get_origin(hint) or hint)


def _add_flag(
    parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup, f: Field[Any]
) -> None:
    meta = f.metadata
    kind = _value_type(f)
    if f.name == "model":
        parser.add_argument(flag_name(f.name), required=True, help=meta["help"])
    elif kind is bool and "affirm" in meta:  # off by default: `--enable-…` turns it on
        parser.add_argument(meta["affirm"], dest=f.name, action="store_true", help=meta["help"])
    elif kind is bool:
        parser.add_argument(
            meta["negate"], dest=f.name, action="store_false", help=f"do not {meta['help']}"
        )
    elif kind is tuple:  # several values: `--flag A B` or `--flag=A --flag=B`
        parser.add_argument(
            flag_name(f.name), type=str, nargs="+", action="extend", help=meta["help"]
        )
    else:
        parser.add_argument(
            flag_name(f.name),
            type=kind,
            choices=meta.get("choices"),
            help=meta["help"]
            if f.default in (None, "")
            else f"{meta['help']} (default: {f.default})",
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpilot-runtime serve",
        description="Serve the OpenAI-compatible API over kvpilot's batching engine.",
        argument_default=argparse.SUPPRESS,  # an absent flag keeps the field's default
    )
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for f in fields(ServeConfig):
        group = f.metadata.get("group")
        if group and group not in groups:
            groups[group] = p.add_mutually_exclusive_group()
        _add_flag(groups[group] if group else p, f)
    return p


def parse_args(argv: list[str]) -> ServeConfig:
    """Parse flags into a `ServeConfig`; raises ValueError for values argparse cannot check."""
    values = vars(build_parser().parse_args(argv))
    source = parse_model_uri(values["model"])
    if source.scheme == "pvc":
        raise ValueError(
            f"--model {source.uri!r}: the runtime cannot open a PersistentVolumeClaim; the kvpilot "
            "operator mounts pvc:// models into the pod at a path and passes that path here"
        )
    if source.scheme == "file":
        values["model"] = _local_dir(source)
    for name in ("lora_modules", "lora_claims"):
        if name in values:
            values[name] = tuple(values[name])
    values.setdefault(
        "served_name", source.name if source.is_fetched else Path(values["model"]).name
    )
    return ServeConfig(**values)


def _local_dir(source: ModelSource) -> str:
    path = Path(source.location)
    if not path.is_dir():
        raise ValueError(
            f"--model {source.uri!r}: {path} is not a directory with an HF-format checkpoint"
        )
    return str(path)


def to_args(values: Mapping[str, object]) -> list[str]:
    """`--flag=value` for each field name in `values` (None: left out, False: the `--no-…`
    switch); a name that is not a ServeConfig field is a KeyError, so a writer of pod args
    cannot invent a flag the runtime does not parse."""
    by_name = {f.name: f for f in fields(ServeConfig)}
    args = []
    for name, value in values.items():
        if name not in by_name:
            raise KeyError(f"{name!r} is not a kvpilot-runtime serve flag")
        meta = by_name[name].metadata
        is_switch_on = "affirm" in meta  # `--enable-…`: present when True, absent otherwise
        if value is True and is_switch_on:
            args.append(meta["affirm"])
        elif value is None or value is True or value == () or (value is False and is_switch_on):
            continue
        elif value is False:
            args.append(meta["negate"])
        elif isinstance(value, tuple):
            args += [f"{flag_name(name)}={item}" for item in value]
        else:
            args.append(f"{flag_name(name)}={value}")
    return args
