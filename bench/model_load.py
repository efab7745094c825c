"""Model start-up: fetching from each source and loading, against loading from local disk.

    .venv/bin/python -m bench.model_load [--repeats 3]

Starts the dev cluster's model servers (olah as the Hugging Face hub, SeaweedFS as S3) in a temp
dir, then for each source runs `kvpilot-runtime fetch` into a fresh directory (what each
replica's init container does today), a second fetch into the same directory (a resumed fetch:
listing and verification only), and the engine load from that directory. The `local` row is a
replica whose model is already on local storage, which is what a filled model-cache volume
gives. Wall-clock seconds, the median of `--repeats` interleaved runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.report import markdown_table, write_section
from hack.devcluster import modelsources, procs
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "tiny-llama"
SOURCES = ("local", "hf://kvpilot/tiny-llama", "s3://models/tiny-llama")


def fetch_seconds(uri: str, dest: Path, env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "kvpilot.runtime.cli", "fetch", "--model", uri, "--to", str(dest)],
        env=env,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - started


def load_seconds(model_dir: Path) -> float:
    started = time.perf_counter()
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", kv_cache_memory=16 << 20))
    seconds = time.perf_counter() - started
    engine.shutdown()
    return seconds


def measure(uri: str, work: Path, env: dict[str, str]) -> tuple[float, float, float]:
    """(first fetch, resumed fetch, load) seconds; a local model has nothing to fetch."""
    if uri == "local":
        return 0.0, 0.0, load_seconds(TINY)
    dest = Path(tempfile.mkdtemp(dir=work))
    first = fetch_seconds(uri, dest, env)
    resumed = fetch_seconds(uri, dest, env)
    return first, resumed, load_seconds(dest)


def run(repeats: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        hub_port, s3_port = procs.free_port(), procs.free_port()
        modelsources.start_hf_hub(state, hub_port)
        modelsources.start_s3(state, s3_port)
        env = {**os.environ, **modelsources.client_env(hub_port, s3_port), "HF_HOME": tmp}
        try:
            runs: dict[str, list[tuple[float, float, float]]] = {uri: [] for uri in SOURCES}
            for _ in range(repeats):  # interleaved, so load drifts hit every source alike
                for uri in SOURCES:
                    runs[uri].append(measure(uri, state, env))
        finally:
            modelsources.stop(state)
    return report(runs, repeats)


def report(runs: dict[str, list[tuple[float, float, float]]], repeats: int) -> str:
    local_load = statistics.median(r[2] for r in runs["local"])
    rows = []
    for uri, samples in runs.items():
        first, resumed, load = (statistics.median(s[i] for s in samples) for i in range(3))
        rows.append([uri, f"{first:.2f}", f"{resumed:.2f}", f"{load:.2f}",
                     f"{(first + load) / local_load:.1f}x"])  # fmt: skip
    table = markdown_table(
        ["source", "fetch s", "resumed fetch s", "load s", "fetch + load vs local load"], rows
    )
    size = sum(p.stat().st_size for p in TINY.iterdir() if p.is_file()) / 2**20
    return (
        f"models/tiny-llama ({size:.1f} MiB on disk), CPU engine load, median of {repeats} "
        "interleaved runs. The fetch is `kvpilot-runtime fetch` as a process (what the init "
        "container runs: Python start-up, listing, download, sha256/size verification).\n\n"
        f"{table}\n\nWithout spec.model.cache every replica pays the fetch (an emptyDir per pod); "
        "the `local` row is what a replica pays once its model is on local storage, which the "
        "model cache gives every replica after the fill (bench.model_cache_startup measures "
        "that on real pods). On a 7.6 MiB model the "
        "fetch is mostly process start-up and verification; on a 15 GB checkpoint it is the "
        "download.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.model_load")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    body = run(args.repeats)
    print(body)
    write_section(
        "model_load", "Model start-up: fetch from the source vs load from local disk",
        "python -m bench.model_load", body,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
