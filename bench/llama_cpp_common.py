"""llama.cpp's `llama-server` as the benchmarks' CPU peer: built once from the source that the
PyPI sdist of `llama-cpp-python` vendors, models converted with that tree's converter.

Bench-only: nothing in the runtime imports this. Everything lands in the version-keyed cache
outside the clone (as hack/devcluster/build.py does for the Go tools), so a fresh clone reuses
it and a new pin builds anew:

    ~/.cache/kvpilot/llama-cpp/sdist/       the downloaded sdist
    ~/.cache/kvpilot/llama-cpp/src-VERSION/ its unpacked tree (vendor/llama.cpp)
    ~/.cache/kvpilot/bin/llama-server-VERSION/llama-server
    ~/.cache/kvpilot/llama-cpp/gguf/        converted models, keyed by checkpoint and version
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import IO

from bench.server_common import serving
from hack.devcluster.procs import free_port, http_ok
from hack.devcluster.versions import cache_dir

# llama-cpp-python 0.3.36 vendors llama.cpp with ggml 0.25.3.
VERSION = "0.3.36"
PROGRESS_EVERY_S = 30.0
BUILD_MINUTES_ON_2_CORES = 5  # measured (265 s on 2 cores): the server target alone, Release
BUILD_TOOLS = ("cmake", "ninja", "c++")
# Ninja's status line: `[finished/total] what it runs`, one per edge in the build log.
NINJA_STATUS = re.compile(r"^\[(\d+)/(\d+)\] ", re.MULTILINE)
CMAKE_FLAGS = [
    "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
]  # fmt: skip
# The converter picks a pre-tokenizer by hashing how the tokenizer splits a probe text and knows
# only published vocabularies; tiny-llama's (and the compute-bound model's) is a byte-level BPE
# with GPT-2's split regex, which is llama.cpp's "gpt-2" pre-tokenizer. The converter also
# imports sentencepiece before it looks for a tokenizer.model; these checkpoints have none, so
# the runner answers "no tokenizer.model" first (the converter's own fallback then applies).
CONVERT_RUNNER = """
import sys
tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/gguf-py"]
from conversion import base
sentencepiece_vocab = base.TextModel._set_vocab_sentencepiece
def set_vocab_sentencepiece(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return sentencepiece_vocab(self)
base.TextModel._set_vocab_sentencepiece = set_vocab_sentencepiece
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def root() -> Path:
    return cache_dir() / "llama-cpp"


def server_binary() -> Path:
    return cache_dir() / "bin" / f"llama-server-{VERSION}" / "llama-server"


def source_tree() -> Path:
    return root() / f"src-{VERSION}" / "vendor" / "llama.cpp"


def ensure_source() -> Path:
    """The sdist's llama.cpp tree, downloaded and unpacked once."""
    tree = source_tree()
    if (tree / "CMakeLists.txt").is_file():
        return tree
    sdists = root() / "sdist"
    sdist = sdists / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        print(f"==> downloading the llama-cpp-python {VERSION} sdist", flush=True)
        pip = [sys.executable, "-m", "pip"] if has_pip() else ["python3", "-m", "pip"]
        subprocess.run([*pip, "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", str(sdists)], check=True)  # fmt: skip
    staging = root() / f"src-{VERSION}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        archive.extractall(staging, filter="data")
    (inner,) = staging.iterdir()  # llama_cpp_python-VERSION/
    inner.rename(root() / f"src-{VERSION}")
    staging.rmdir()
    return tree


def has_pip() -> bool:
    probe = [sys.executable, "-m", "pip", "--version"]
    return subprocess.run(probe, check=False, capture_output=True).returncode == 0


def ensure_server() -> Path:
    """`llama-server`, built once (only that target, -march=native, Release) into the cache."""
    binary = server_binary()
    if binary.is_file():
        return binary
    check_build_tools()
    tree = ensure_source()
    build = root() / f"build-{VERSION}"
    log = cache_dir() / "build-logs" / f"llama-server-{VERSION}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"==> building llama-server {VERSION} into {binary.parent} (once per version; about "
        f"{BUILD_MINUTES_ON_2_CORES} min on 2 cores; `make bench BENCH_SKIP=engine_peer` skips "
        f"the peer benchmark; log: {log})",
        flush=True,
    )
    started = time.monotonic()
    with log.open("a") as out:
        run_logged(["cmake", "-S", str(tree), "-B", str(build), *CMAKE_FLAGS], out, started)
        run_logged(["cmake", "--build", str(build), "--target", "llama-server"], out, started)
    binary.parent.mkdir(parents=True, exist_ok=True)
    staging = binary.with_suffix(".partial")
    shutil.copy2(build / "bin" / "llama-server", staging)
    staging.rename(binary)  # atomic: a half-copied binary is never taken for a build
    print(f"    built llama-server in {time.monotonic() - started:.0f}s", flush=True)
    return binary


def check_build_tools() -> None:
    """A missing compiler fails here in one line, not an hour into a build."""
    missing = [tool for tool in BUILD_TOOLS if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(
            f"building llama-server needs {', '.join(BUILD_TOOLS)}; not found: "
            f"{', '.join(missing)} (Debian: apt-get install cmake ninja-build g++), or leave "
            "the peer benchmark out: make bench BENCH_SKIP=engine_peer"
        )


def build_progress(log_text: str) -> str:
    """How far the build is, from ninja's last status line in the log: `412/1030 steps (40%)`,
    or "configuring" before ninja has started. Only the last command's output counts: the
    log keeps earlier (failed) builds above it."""
    last_command = log_text[log_text.rfind("\n$ ") + 1 :]
    matches = NINJA_STATUS.findall(last_command)
    if not matches:
        return "configuring"
    done, total = (int(n) for n in matches[-1])
    return f"{done}/{total} steps ({100 * done // max(total, 1)}%)"


def run_logged(argv: list[str], out: IO[str], started: float) -> None:
    out.write(f"$ {' '.join(argv)}\n")
    out.flush()
    process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    while True:
        try:
            code = process.wait(timeout=PROGRESS_EVERY_S)
            break
        except subprocess.TimeoutExpired:
            progress = build_progress(Path(out.name).read_text(errors="replace"))
            elapsed = time.monotonic() - started
            print(f"    ... still building: {progress}, {elapsed / 60:.0f} min", flush=True)
    if code != 0:
        raise RuntimeError(f"{argv[0]} exited {code}; see {out.name}")


def checkpoint_key(model_dir: Path) -> str:
    """Changes when the checkpoint does (its config, the sizes of its weight files) or the way
    it is converted."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes() + CONVERT_RUNNER.encode())
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()[:12]


def ensure_gguf(model_dir: Path, outtype: str) -> Path:
    """`model_dir` as GGUF (`bf16`, `q8_0`, ...), converted once by the tree's converter."""
    out = root() / "gguf" / f"{model_dir.name}-{checkpoint_key(model_dir)}-{outtype}-{VERSION}.gguf"
    if out.is_file():
        return out
    tree = ensure_source()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    print(f"==> converting {model_dir.name} to GGUF {outtype}", flush=True)
    argv = [sys.executable, "-c", CONVERT_RUNNER, str(tree), str(model_dir),
            "--outtype", outtype, "--outfile", str(partial)]  # fmt: skip
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial.rename(out)
    return out


@contextmanager
def llama_server(
    gguf: Path, parallel: int, ctx_per_slot: int, threads: int
) -> Iterator[tuple[str, int]]:
    """(base URL, pid) of `llama-server` serving `gguf` as `tiny` on a free port of 127.0.0.1:
    `parallel` slots of `ctx_per_slot` tokens (continuous batching), `threads` for generation
    and prompts alike. Each slot has its own KV stream (--no-kv-unified): in one unified buffer
    the prompts every slot keeps cached (cache_prompt) widen the cells each decode attends over,
    and a server that had served a few rounds ran 8x slower at concurrency 8-64 than a fresh
    one."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(ensure_server()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--alias", "tiny", "--parallel", str(parallel), "--ctx-size",
            str(parallel * ctx_per_slot), "--threads", str(threads), "--threads-batch",
            str(threads), "--batch-size", "2048", "--no-kv-unified", "--log-disable"]  # fmt: skip
    health = f"{url}/health"
    quiet = subprocess.DEVNULL
    with serving(argv, partial(http_ok, health), "llama-server", start_s=300, stop_s=60,
                 stdout=quiet, stderr=quiet) as process:  # fmt: skip
        yield url, process.pid


def main() -> int:
    """Build (or find) the server: `python -m bench.llama_cpp_common`."""
    print(ensure_server())
    return 0


if __name__ == "__main__":
    sys.exit(main())
