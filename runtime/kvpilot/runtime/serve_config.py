"""`kvpilot-runtime serve` flags, parsed once at the edge into a frozen `ServeConfig`.

The flag names follow DESIGN.md §3.4 (and vLLM's where they overlap) so a pod spec written for one
reads the same for the other.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

QUANTIZATIONS = ("none", "bf16", "int8", "int4")
DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ServeConfig:
    model: str  # local path to an HF-format directory (already resolved from the URI)
    served_name: str
    host: str = "0.0.0.0"
    port: int = 8000
    quantization: str = "none"
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    max_waiting: int = 256
    api_key: str | None = None
    shutdown_timeout: float = 30.0
    seed: int = 0
    log_level: str = "info"

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.port <= 65535, f"port must be in 1..65535, got {self.port}"),
            (self.quantization in QUANTIZATIONS, f"quantization must be one of {QUANTIZATIONS}"),
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"),
            (self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (
                0.0 < self.gpu_memory_utilization <= 1.0,
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
            ),
            (
                self.kv_cache_memory is None or self.kv_cache_memory > 0,
                "kv_cache_memory must be > 0",
            ),
            (self.max_waiting >= 0, f"max_waiting must be >= 0, got {self.max_waiting}"),
            (self.shutdown_timeout >= 0, "shutdown_timeout must be >= 0"),
            (self.api_key is None or self.api_key != "", "api_key must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def resolve_model_path(uri: str) -> str:
    """`--model` as a local directory: a plain path or file:///path; other schemes are errors."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        path = Path(unquote(parsed.path))
    elif parsed.scheme == "" or len(parsed.scheme) == 1:  # len 1: a Windows drive letter
        path = Path(uri)
    else:
        raise ValueError(
            f"--model {uri!r}: this runtime loads models from a local path (or file:///path); "
            f"the kvpilot operator mounts {parsed.scheme}:// models into the pod at a path and "
            "passes that path here"
        )
    if not path.is_dir():
        raise ValueError(f"--model {uri!r}: {path} is not a directory with an HF-format checkpoint")
    return str(path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpilot-runtime serve", description=__doc__)
    p.add_argument("--model", required=True, help="local path or file:///path of an HF checkpoint")
    p.add_argument("--served-name", help="model id clients send (default: directory name)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    memory = p.add_mutually_exclusive_group()
    memory.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    memory.add_argument("--kv-cache-memory", type=int, help="KV-cache pool size in bytes")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/*")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="drain time on SIGTERM")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="info")
    return p


def parse_args(argv: list[str]) -> ServeConfig:
    """Parse flags into a `ServeConfig`; raises ValueError for values argparse cannot check."""
    args = build_parser().parse_args(argv)
    model = resolve_model_path(args.model)
    return ServeConfig(
        model=model,
        served_name=args.served_name or Path(model).resolve().name,
        host=args.host,
        port=args.port,
        quantization=args.quantization,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=not args.no_prefix_caching,
        max_waiting=args.max_waiting,
        api_key=args.api_key,
        shutdown_timeout=args.shutdown_timeout,
        seed=args.seed,
        log_level=args.log_level,
    )
