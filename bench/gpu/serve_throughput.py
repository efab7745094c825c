"""Serving throughput on one GPU, beside vLLM's published figures: a Llama-3.1-8B-shaped model with
random bf16 weights (bench/gpu/random_checkpoint.py, no network), served by `kvpilot-runtime
serve` and loaded by `kvpilot bench` with random-token prompts (token ids, no shared prefix) and
--ignore-eos, so every request asks for exactly its output length.

    python -m bench.gpu.serve_throughput --device cuda --out DIR [--variants graphs,eager,...]

Each variant is one server (its flags below) running its workloads (input/output tokens at a
concurrency, as many requests as the concurrency: one wave, a minimum of 2 at concurrency 1):
output tok/s, TTFT and TPOT p50/p95. The anchor (issue 38): vLLM 0.8.2 on one H200 at
1000/2000 tokens, 4,528.6 output tok/s; SGLang 0.4.4 4,031.5. With `vllm` importable, the same
client runs against `vllm serve` of the same checkpoint. `--device cpu` is the dry run: the tiny
shape and short workloads, every variant, so the script is known to run end to end.

Each row is written (DIR/serve_throughput.md and .json) as soon as it is measured: a run stopped
at its time limit keeps what it had measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu.random_checkpoint import SHAPES, write_random_checkpoint
from bench.report import command_line, write_section

TITLE = "Serving throughput on one GPU: a Llama-3.1-8B-shaped model (random bf16 weights)"
# (input tokens, output tokens) per workload name
WORKLOADS = {"cuda": {"1000/2000": (1000, 2000), "1000/1000": (1000, 1000)},
             "cpu": {"1000/2000": (24, 16), "1000/1000": (24, 8)}}  # fmt: skip
FULL = (("1000/2000", 1), ("1000/2000", 64), ("1000/2000", 256),
        ("1000/1000", 1), ("1000/1000", 64), ("1000/1000", 256))  # fmt: skip


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]
    runs: tuple[tuple[str, int], ...]  # (workload, concurrency)


# Sized for one H100 call (<= 8 minutes, unmeasured: estimated from ~7 ms/token at batch 1 and a
# 2,000-step wave at batch 64): the graphs' variant runs every workload, the others the rows
# their comparison needs. On CPU every concurrency is divided by 16.
VARIANTS = (
    Variant("graphs", (), FULL),
    Variant("eager", ("--enforce-eager",), (("1000/2000", 1), ("1000/2000", 64))),
    Variant("sdpa", ("--attention-backend", "sdpa"), (("1000/2000", 1), ("1000/2000", 64))),
    Variant("fp8-kv", ("--kv-cache-dtype", "fp8"), (("1000/2000", 64), ("1000/2000", 256))),
    Variant("int8", ("--quantization", "int8"), (("1000/2000", 1), ("1000/2000", 64))),
)
SERVER_FLAGS = ("--max-num-seqs", "256", "--max-model-len", "3072",
                "--max-num-batched-tokens", "8192", "--log-level", "info")  # fmt: skip


def num_requests(concurrency: int) -> int:
    return max(2, concurrency)


def token_prompts(path: Path, count: int, input_len: int, output_len: int, vocab: int,
                  seed: int) -> Path:  # fmt: skip
    """A JSONL of `count` prompts of random token ids (never BOS or EOS, the last two)."""
    import random

    rng = random.Random(seed)
    lines = [json.dumps({"prompt": [rng.randrange(vocab - 2) for _ in range(input_len)],
                         "max_tokens": output_len}) for _ in range(count)]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def run_client(
    base_url: str, model: Path, dataset: Path, count: int, concurrency: int, out: Path
) -> dict[str, Any]:
    """`kvpilot bench` of the dataset's `count` prompts against the server; its summary (tok/s,
    TTFT, TPOT in ms)."""
    from kvpilot.runtime.bench.cli import main as bench_main

    argv = ["--base-url", base_url, "--dataset", str(dataset), "--tokenizer", str(model),
            "--num-prompts", str(count), "--concurrency", str(concurrency), "--ignore-eos",
            "--percentiles", "50,95", "--no-progress", "--result-json", str(out)]  # fmt: skip
    if bench_main(argv) != 0:
        raise RuntimeError(f"kvpilot bench failed: {' '.join(argv)}")
    summary: dict[str, Any] = json.loads(out.read_text())["summary"]
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    return summary


def row(server: str, workload: str, concurrency: int, summary: dict[str, Any]) -> dict[str, Any]:
    ttft, tpot = summary["ttft_ms"]["percentiles"], summary["tpot_ms"]["percentiles"]
    return {
        "server": server, "workload": workload, "concurrency": concurrency,
        "requests": summary["completed"], "output_tok_s": summary["output_throughput"],
        "ttft_p50_ms": ttft["p50"], "ttft_p95_ms": ttft["p95"],
        "tpot_p50_ms": tpot["p50"], "tpot_p95_ms": tpot["p95"],
    }  # fmt: skip


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| server | in/out tokens | concurrency | requests | output tok/s | TTFT p50 / p95 ms "
             "| TPOT p50 / p95 ms |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| {r['server']} | {r['workload']} | {r['concurrency']} | {r['requests']} | "
        f"{r['output_tok_s']:,.1f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f} | "
        f"{r['tpot_p50_ms']:.1f} / {r['tpot_p95_ms']:.1f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


class Results:
    """Rows as they come, written after each one."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[dict[str, Any]] = []
        out.mkdir(parents=True, exist_ok=True)

    def add(self, new: dict[str, Any]) -> None:
        self.rows.append(new)
        print(markdown([new]).splitlines()[-1], flush=True)
        (self.out / "serve_throughput.json").write_text(json.dumps(self.rows, indent=1))
        (self.out / "serve_throughput.md").write_text(markdown(self.rows))


def run_variant(variant: Variant, model: Path, device: str, work: Path, results: Results) -> None:
    from bench.server_common import runtime_server

    flags = (*SERVER_FLAGS, "--device", device, *variant.flags)
    with runtime_server(model, *flags) as (url, _):
        for workload, concurrency in variant.runs:
            measure(f"kvpilot {variant.name}", url, model, device, workload, concurrency, work,
                    results)  # fmt: skip


def measure(server: str, url: str, model: Path, device: str, workload: str, concurrency: int,
            work: Path, results: Results) -> None:  # fmt: skip
    if device == "cpu":
        concurrency = max(1, concurrency // 16)
    input_len, output_len = WORKLOADS[device][workload]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    shape, count = f"{input_len}/{output_len}", num_requests(concurrency)
    name = f"{input_len}-{output_len}-c{concurrency}"
    dataset = token_prompts(work / f"{name}.jsonl", count, input_len, output_len, vocab,
                            seed=concurrency)  # fmt: skip
    result = work / f"{server.replace(' ', '-')}-{name}.json"
    summary = run_client(url, model, dataset, count, concurrency, result)
    results.add(row(server, shape, concurrency, summary))


def run_vllm(model: Path, work: Path, results: Results) -> None:
    """The graphs variant's workloads against `vllm serve` of the same checkpoint."""
    import subprocess
    from functools import partial

    from bench.server_common import serving
    from hack.devcluster.procs import free_port, http_ok

    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--port", str(port), "--max-num-seqs", "256", "--max-model-len", "3072"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with serving(argv, partial(http_ok, f"{url}/health"), "vllm serve", start_s=400,
                 stdout=subprocess.DEVNULL):  # fmt: skip
        for workload, concurrency in FULL:
            measure("vLLM", url, model, "cuda", workload, concurrency, work, results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default=",".join([*(v.name for v in VARIANTS), "vllm"]),
                        help="which servers, comma-separated (default: all), and vllm")  # fmt: skip
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    wanted = set(args.variants.split(","))
    unknown = wanted - {v.name for v in VARIANTS} - {"vllm"}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}")
    shape = SHAPES["llama-3.1-8b" if args.device == "cuda" else "tiny"]
    results = Results(args.out)
    with tempfile.TemporaryDirectory(prefix="kvpilot-serve-") as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        model = write_random_checkpoint(work / "model", shape, args.device)
        print(f"random checkpoint written in {time.perf_counter() - start:.0f} s", flush=True)
        for variant in VARIANTS:
            if variant.name in wanted:
                run_variant(variant, model, args.device, work, results)
        if "vllm" in wanted:
            if importlib.util.find_spec("vllm") is None:
                print("vllm does not import here: no vLLM rows", flush=True)
            else:
                run_vllm(model, work, results)
    if args.device == "cuda":
        text = ("bench/gpu_check.sh --steps serve-throughput on a lent GPU machine: "
                f"{__doc__.split(chr(10) + chr(10))[0]}\n\n")  # fmt: skip
        command = command_line("bench.gpu.serve_throughput", argv)
        write_section("gpu_serve_throughput", TITLE, command, text + markdown(results.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
