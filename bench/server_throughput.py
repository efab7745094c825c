"""Runtime server overhead: output tokens/s through HTTP (64 streams) vs the engine in-process.

    .venv/bin/python -m bench.server_throughput [--num-requests 128]

The same requests (token-id prompts, greedy, fixed output lengths with ignore_eos) run first on
an in-process Engine with max_num_seqs=64 (its scheduler keeps 64 in flight, a closed loop of 64),
then through `kvpilot-runtime serve` driven by `kvpilot bench --concurrency 64`. Also reports TTFT
p95 and tokens/s at concurrency 1, 8 and 64. Client, server and engine share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import server_common
from bench.engine_common import (
    MODEL,
    Request,
    drain,
    fmt_ratio,
    greedy,
    make_engine,
    mixed_workload,
    setup_threads,
)
from bench.report import markdown_table, write_section
from kvpilot.runtime.bench.cli import benchmark, parse_args
from kvpilot.runtime.bench.stats import Summary

MAX_NUM_SEQS = 64
MAX_MODEL_LEN = 512
CONCURRENCIES = (1, 8, 64)
# One intra-op thread on both sides: on a shared CPU, OpenMP threads spin while a sibling is
# descheduled, which would make either side's figure depend on other processes' load.
TORCH_THREADS = 1


@dataclass(frozen=True)
class Measured:
    num_tokens: int
    wall_s: float
    cpu_s: float  # CPU time of the engine's process (in-process) or of the server process
    client_cpu_s: float = 0.0  # the HTTP client's, on this machine only because of the benchmark

    @property
    def tps(self) -> float:
        return self.num_tokens / self.wall_s

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.num_tokens / self.cpu_s

    @property
    def tokens_per_cpu_s_with_client(self) -> float:
        return self.num_tokens / (self.cpu_s + self.client_cpu_s)


def run_in_process(requests: list[Request]) -> Measured:
    engine = make_engine(max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)
    start, cpu = time.perf_counter(), time.process_time()
    for index, req in enumerate(requests):
        engine.add_request(req.prompt, greedy(req.num_output_tokens), str(index))
    drain(engine)
    num_tokens = sum(r.num_output_tokens for r in requests)
    return Measured(num_tokens, time.perf_counter() - start, time.process_time() - cpu)


def process_cpu_s(pid: int) -> float:
    """utime + stime of another process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def runtime_server() -> Iterator[tuple[str, int]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(TORCH_THREADS)}
    limits = ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(MAX_MODEL_LEN)]
    with server_common.runtime_server(MODEL, *limits, env=env) as served:
        yield served


def run_http(url: str, dataset: Path, num_requests: int, concurrency: int) -> Summary:
    config = parse_args([
        "--base-url", url, "--model", "tiny", "--dataset", str(dataset), "--num-prompts",
        str(num_requests), "--concurrency", str(concurrency), "--ignore-eos", "--no-progress",
    ])  # fmt: skip
    summary, _ = benchmark(config)
    if summary.failed:
        raise RuntimeError(f"{summary.failed} requests failed: {summary.errors}")
    return summary


def measure_http(url: str, pid: int, dataset: Path, num_requests: int) -> Measured:
    server_cpu, client_cpu = process_cpu_s(pid), time.process_time()
    summary = run_http(url, dataset, num_requests, MAX_NUM_SEQS)
    server_cpu = process_cpu_s(pid) - server_cpu
    client_cpu = time.process_time() - client_cpu
    return Measured(summary.total_output_tokens, summary.duration_s, server_cpu, client_cpu)


def write_dataset(requests: list[Request], directory: Path) -> Path:
    path = directory / "workload.jsonl"
    lines = [json.dumps({"prompt": r.prompt, "max_tokens": r.num_output_tokens}) for r in requests]
    path.write_text("\n".join(lines) + "\n")
    return path


def sweep(url: str, dataset: Path, num_requests: int) -> list[list[object]]:
    """TTFT p95 and tokens/s through HTTP at each concurrency."""
    rows: list[list[object]] = []
    for concurrency in CONCURRENCIES:
        count = min(num_requests, max(8, 2 * concurrency))
        s = run_http(url, dataset, count, concurrency)
        p95, tpot = s.ttft_ms.percentiles["p95"], s.tpot_ms.mean
        rows.append([concurrency, count, f"{p95:.1f}", f"{tpot:.1f}", f"{s.output_throughput:.1f}"])
    return rows


def report(args: argparse.Namespace, engine: list[Measured], http: list[Measured],
           rows: list[list[object]]) -> str:  # fmt: skip
    def per_round(runs: list[Measured], attr: str) -> str:
        return ", ".join(f"{getattr(m, attr):.1f}" for m in runs)

    def best(runs: list[Measured], attr: str) -> float:
        return max(getattr(m, attr) for m in runs)

    table: list[list[object]] = [
        ["engine in-process", per_round(engine, "tokens_per_cpu_s"), "-", per_round(engine, "tps")],
        ["HTTP, 64 concurrent streams", per_round(http, "tokens_per_cpu_s"),
         per_round(http, "tokens_per_cpu_s_with_client"), per_round(http, "tps")],
    ]  # fmt: skip
    cpu_ratio = best(http, "tokens_per_cpu_s") / best(engine, "tokens_per_cpu_s")
    client_ratio = best(http, "tokens_per_cpu_s_with_client") / best(engine, "tokens_per_cpu_s")
    wall_ratio = best(http, "tps") / best(engine, "tps")
    header = ["concurrency", "requests", "TTFT p95 (ms)", "TPOT mean (ms)", "output tok/s"]
    columns = ["", "output tok per CPU-s", "... counting the client too", "output tok/s (wall)"]
    return (
        f"Workload: {args.num_requests} requests, prompts 32-256 tokens, outputs 32-64 tokens "
        "(greedy, ignore_eos), tiny-llama, `--max-num-seqs 64`, one torch thread on CPU for "
        f"both; the two ways alternate for {args.rounds} rounds, best round counts. Other "
        "processes share this machine's cores, so wall-clock tokens/s swings with their load; "
        "output tokens per CPU-second of the process doing the work (the engine's, or the "
        "server's) is the steadier measure of what the HTTP layer costs. The load generator "
        "runs on the same cores, which a real client would not. In-process, all requests are "
        "added at once and the scheduler runs 64 at a time; through HTTP, 64 clients each send "
        "their next request when one finishes.\n\n"
        + markdown_table(columns, table)
        + f"\n\nHTTP / in-process, per CPU-second of the server: {fmt_ratio(cpu_ratio, 0.9)}  \n"
        + f"... counting the client's CPU too: {client_ratio:.2f}x  \n"
        + f"HTTP / in-process, wall clock: {wall_ratio:.2f}x\n\n"
        + "Through HTTP, by client concurrency:\n\n"
        + markdown_table(header, rows)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    setup_threads()
    if not torch.cuda.is_available():
        torch.set_num_threads(TORCH_THREADS)
    requests = mixed_workload(args.num_requests, (32, 256), (32, 64), seed=0)
    engine: list[Measured] = []
    http: list[Measured] = []
    with tempfile.TemporaryDirectory() as tmp, runtime_server() as (url, pid):
        dataset = write_dataset(requests, Path(tmp))
        run_http(url, dataset, 8, 8)  # warm-up: first requests pay one-off costs
        for _ in range(args.rounds):
            engine.append(run_in_process(requests))
            http.append(measure_http(url, pid, dataset, args.num_requests))
        rows = sweep(url, dataset, args.num_requests)
    body = report(args, engine, http, rows)
    print(body)
    command = f"python -m bench.server_throughput --num-requests {args.num_requests}"
    write_section("server_throughput", "Runtime server: HTTP vs in-process engine", command, body)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
