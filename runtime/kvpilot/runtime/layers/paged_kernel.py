"""The CPU decode-attention kernel over the paged KV cache (paged_decode.cpp), built once per
machine and loaded as `torch.ops.kvpilot.paged_decode_attention`; the same library holds
`torch.ops.kvpilot.int4_tiles` (int4_tiles.cpp), which writes a pre-quantised int4 checkpoint's
words into the CPU int4 kernel's tiles at load, `torch.ops.kvpilot.lora_add_` (lora_add.cpp),
multi-LoRA's delta for a decode-like step's rows, and `torch.ops.kvpilot.dense_rows`
(dense_rows.cpp), a dense projection of a decode step's one or two rows.

No well-kept CPU paged-attention kernel installs beside current torch (IPEX stops at torch 2.8,
vLLM's CPU kernels ship only in its own CPU builds, torchao's PyPI wheel has CUDA kernels only),
and torch's SDPA needs each sequence's keys and values copied out of the pool first. So the
kernel is ours: ~650 lines of C++, compiled by torch.utils.cpp_extension with -march=native the
first time a process asks for it (~15 s on 2 cores), then loaded from ~/.cache/kvpilot/kernels
(KVPILOT_KERNEL_CACHE), keyed by the source, the flags, torch, Python and the CPU's flags.

A library the cache holds is loaded as it is, with no rebuild check: the key already names
everything it was built from, and torch's check (ninja over a build file that names the source's
path and mtime) rebuilt it whenever another checkout of the same source had used the cache last,
which cost a pod start 70-95 s on a loaded 2-core machine (docs/benchmarks.md, cold start).

    python -m kvpilot.runtime.layers.paged_kernel     # build now (make setup does), print where
    python -m kvpilot.runtime.layers.paged_kernel --portable x86-64-v3 --out DIR   # for an image

Where neither this machine's cache nor a compiler has it, a kernel prebuilt for a portable
x86-64 level is loaded from the venv (`prebuilt_root`, which `make images` fills).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

# One library, its ops registered as torch.ops.kvpilot.*: decode attention over the paged cache,
# the int4 tile writer a GPTQ/AWQ/compressed-tensors checkpoint's load runs (int4_tiles.cpp),
# multi-LoRA's delta for a decode-like step's rows (lora_add.cpp) and the dense projection of a
# decode step's few rows (dense_rows.cpp).
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("paged_decode.cpp", "int4_tiles.cpp", "lora_add.cpp", "dense_rows.cpp")
)
# included by the sources: keyed too
HEADERS = tuple(Path(__file__).with_name(name) for name in ("float_convert.h", "float_lanes.h"))
CACHE_ENV = "KVPILOT_KERNEL_CACHE"
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
# Written into the build directory once a build has loaded in its process: it names the built
# library, so a later process loads a complete library, never one a build is still writing.
BUILT_MARK = "built"
# Kernels built when an image is built (hack/images), one per portable x86-64 level, loaded
# where this CPU has the level's features: a pod then runs the kernel without a compiler and
# never compiles it at start. The levels' features as /proc/cpuinfo names them, best first.
PREBUILT_ENV = "KVPILOT_PREBUILT_KERNELS"
_V4 = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
PORTABLE_LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("x86-64-v4-bf16", _V4 | {"avx512_bf16"}),
    ("x86-64-v4", _V4),
    ("x86-64-v3", frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"})),
)
# A level past the psABI's is the one it extends plus features: x86-64-v4-bf16 adds AVX512-BF16
# (Cooper Lake, Sapphire Rapids and Zen 4 on), whose dot product dense_rows.cpp multiplies a bf16
# decode step's projections with; the others are -march=<level>.
LEVEL_MARCH = {"x86-64-v4-bf16": ("-march=x86-64-v4", "-mavx512bf16")}


class KernelUnavailableError(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why and what to do."""


def cache_root() -> Path:
    default = Path.home() / ".cache" / "kvpilot" / "kernels"
    return Path(os.environ.get(CACHE_ENV) or default)


def build_key() -> str:
    """What the compiled library depends on: its source, torch, Python and (for -march=native)
    the CPU it was built for."""
    from kvpilot.runtime.engine import (
        machine_files,  # /proc reads stay out of import time
    )

    digest = _sources_digest()
    flags = sorted(machine_files.cpu_flags())
    for part in (torch.__version__, sys.version, platform.machine(), *COMPILE_FLAGS, *flags):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _sources_digest() -> Any:  # hashlib's hash object, which typeshed keeps private
    return hashlib.sha256(b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS)))


def prebuilt_root() -> Path:
    """Where an image keeps its prebuilt kernels: under the venv, beside the code they serve."""
    return Path(os.environ.get(PREBUILT_ENV) or Path(sys.prefix) / "share" / "kvpilot" / "kernels")


def portable_flags(level: str) -> list[str]:
    march = LEVEL_MARCH.get(level, (f"-march={level}",))
    return [part for flag in COMPILE_FLAGS for part in (march if "native" in flag else (flag,))]


def portable_key(level: str) -> str:
    """A prebuilt kernel's key: its source, torch, the Python ABI (the image's interpreter is
    not the builder's patch release) and the level's flags; no CPU of its own."""
    digest = _sources_digest()
    parts = (torch.__version__, sys.implementation.cache_tag, platform.machine())
    for part in (*parts, *portable_flags(level)):
        digest.update(part.encode())
    return f"{level}-{digest.hexdigest()[:16]}"


def portable_levels(cpu_flags: frozenset[str]) -> list[str]:
    """The portable levels this CPU runs, best first (pure)."""
    return [level for level, needs in PORTABLE_LEVELS if needs <= cpu_flags]


def load_prebuilt() -> bool:
    """Load the best prebuilt kernel this CPU runs; False when the image ships none for it."""
    from kvpilot.runtime.engine import machine_files

    root = prebuilt_root()
    return any(
        load_built(root / portable_key(level))
        for level in portable_levels(machine_files.cpu_flags())
    )


def build_portable(level: str, out: Path) -> Path:
    """Build the kernel for a portable level into out/<portable_key> (one level per process:
    each build registers the same op). Returns the build directory."""
    build_dir = out / portable_key(level)
    mark_built(build_dir, _build_and_load(build_dir, portable_flags(level)))
    return build_dir


def load() -> None:
    """Build (first time) and load the kernel into this process; KernelUnavailableError, with
    the reason, where it cannot be."""
    reason = unavailable_reason()
    if reason is not None:
        raise KernelUnavailableError(reason)


def loaded_without_building() -> bool:
    """Whether the library is in this process, loaded now where this machine's cache or the image
    holds it built; never builds it. For what has a path without it (the int4 tile writer, the
    LoRA delta): a start that asked for no attention kernel does not wait for a compile."""
    if unavailable_reason.cache_info().currsize:  # loaded or built in this process, or refused
        return unavailable_reason() is None
    return _load_built_here()


@functools.cache
def _load_built_here() -> bool:
    return load_built(cache_root() / build_key()) or load_prebuilt()


@functools.cache
def unavailable_reason() -> str | None:
    """None once the kernel is loaded; otherwise why it cannot be. Cached, failures included: a
    process tries the build once, however many engines it starts."""
    build_dir = cache_root() / build_key()
    try:
        if not (load_built(build_dir) or load_prebuilt()):
            mark_built(build_dir, _build_and_load(build_dir, COMPILE_FLAGS))
    except KernelUnavailableError as error:
        return str(error)
    return None


def load_built(build_dir: Path) -> bool:
    """Load the library an earlier process built here; False when there is none (or it cannot
    be loaded: then it is built again)."""
    mark = build_dir / BUILT_MARK
    if not mark.is_file():
        return False
    try:
        torch.ops.load_library(str(build_dir / mark.read_text()))
    except (OSError, RuntimeError):
        return False
    return True


def mark_built(build_dir: Path, library: Path) -> None:
    """Name the built library for later processes; written whole (replaced, never appended).
    Best effort: without the mark (a full disk), a later process goes through torch's check."""
    partial = build_dir / f"{BUILT_MARK}.{os.getpid()}"
    try:
        partial.write_text(library.name)
        partial.replace(build_dir / BUILT_MARK)
    except OSError:
        partial.unlink(missing_ok=True)


def _build_and_load(build_dir: Path, flags: list[str]) -> Path:
    """The library's path, built (or rebuilt when torch's check says so) and loaded."""
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise KernelUnavailableError(
            f"no C++ compiler ({compiler!r} not on PATH) to build the paged-attention kernel: "
            "install g++ (Debian: apt-get install g++), or pass --attention-backend sdpa"
        )
    try:
        import ninja  # noqa: F401 - torch.utils.cpp_extension builds with it
    except ImportError as error:
        raise KernelUnavailableError(
            "the paged-attention kernel builds with ninja: pip install ninja (the runtime "
            "extra has it), or pass --attention-backend sdpa"
        ) from error
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        library = cpp_extension.load(
            name=f"kvpilot_paged_decode_{build_dir.name}",
            sources=[str(source) for source in SOURCES],
            extra_cflags=flags,
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as error:
        last_line = (str(error).strip().splitlines() or ["no message"])[-1]
        raise KernelUnavailableError(
            f"building the paged-attention kernel in {build_dir} failed ({last_line}); "
            "pass --attention-backend sdpa"
        ) from error
    return Path(str(library))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, H, D]; caches: [num_blocks, BS, H_kv, D] in q's dtype; block_tables: [B, W] int32;
    context_lens: [B] int32 -> [B, H, D]. `load()` must have succeeded in this process."""
    op = torch.ops.kvpilot.paged_decode_attention
    return op(q, k_cache, v_cache, block_tables, context_lens, scale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpilot.runtime.layers.paged_kernel")
    parser.add_argument(
        "--portable",
        choices=[level for level, _ in PORTABLE_LEVELS],
        help="build for this x86-64 level into --out (an image's prebuilt kernel)",
    )
    parser.add_argument("--out", type=Path, help="with --portable: where the build goes")
    args = parser.parse_args(argv)
    if args.portable:
        if args.out is None:
            parser.error("--portable needs --out DIR")
        from kvpilot.runtime.engine import machine_files

        if args.portable not in portable_levels(machine_files.cpu_flags()):
            # torch's builder loads what it built: code for a level this CPU lacks could fault
            print(f"==> skipped {args.portable}: this CPU cannot load code built for it")
            return 0
        try:
            built = build_portable(args.portable, args.out)
        except KernelUnavailableError as error:
            print(f"not built: {error}", file=sys.stderr)
            return 1
        print(f"==> paged-attention kernel for {args.portable}: {built}")
        return 0
    print(f"==> paged-attention kernel: building or loading under {cache_root()} ...", flush=True)
    reason = unavailable_reason()
    if reason is not None:
        print(f"not available: {reason}", file=sys.stderr)
        return 1
    print(f"==> paged-attention kernel ready ({cache_root() / build_key()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
