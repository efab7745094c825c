"""kvpilot vs llama.cpp's `llama-server` on the same CPU, model and client.

    .venv/bin/python -m bench.engine_peer [--rounds 2] [--models tiny,compute]

Both servers run side by side on the same cores (llama.cpp gets the thread count kvpilot chose
by default, read from its /version) and one client, `kvpilot bench`, drives them in turn:
token-id prompts of 128 tokens cut from one text (new ones each round, the same for every server
in it, so no TTFT is a cache hit), 128 output tokens (ignore_eos), greedy, closed loop at
concurrency 1, 8, 32 and 64. The servers alternate within each round (the order
flips every round) and the best of the rounds counts. Reported per server: output tok/s, TTFT
p50/p95, TPOT, and the server's CPU-seconds per 1,000 output tokens (utime + stime from
/proc/PID/stat, so what else runs on this shared machine is not counted).

Models: models/tiny-llama (4 M parameters: it measures per-step overhead) and the random-weight
compute-bound Llama (bench.engine_common.compute_bound_llama, ~237 M, bf16), each converted to
GGUF bf16 by llama.cpp's own converter; the compute-bound one also as kvpilot
`--quantization int8` vs GGUF `q8_0`. Before timing, both servers answer the same sample prompts
greedily and the section says how many of their outputs agree. Also the warm shared-prefix TTFT:
a 1,000-token prefix with distinct 16-token tails (llama.cpp's cache_prompt, its default, and
kvpilot's prefix cache).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import llama_cpp_common, server_common
from bench.engine_common import MODEL, compute_bound_llama, corpus_ids
from bench.report import markdown_table, write_section
from bench.server_throughput import process_cpu_s, run_http

CONCURRENCIES = (1, 8, 32, 64)
INT8_CONCURRENCIES = (1, 8, 32)
PROMPT_LEN = 128
OUTPUT_LEN = 128
MAX_NUM_SEQS = 64
CONTEXT = 1280  # per sequence: room for the 1,000-token shared prefix, its tail and an answer
PREFIX_LEN = 1000
NUM_GREEDY_PROMPTS = 8
GREEDY_TOKENS = 32
# What `serve` chose on CPU before the defaults followed the machine: float32 compute and a
# fixed 256 MiB KV pool (the threads were torch's default, the physical cores, as now here).
PREVIOUS_DEFAULTS = ("--dtype", "float32", "--kv-cache-memory", str(256 * 2**20))


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    pid: int


@dataclass(frozen=True)
class Run:
    tps: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    tpot_ms: float
    cpu_s_per_1k: float


def token_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    ids = corpus_ids()
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - length) for _ in range(count)]
    return [ids[s : s + length] for s in starts]


def write_dataset(prompts: list[list[int]], max_tokens: int, path: Path) -> Path:
    lines = [json.dumps({"prompt": p, "max_tokens": max_tokens}) for p in prompts]
    path.write_text("\n".join(lines) + "\n")
    return path


def measure(server: Server, dataset: Path, num_requests: int, concurrency: int) -> Run:
    cpu = process_cpu_s(server.pid)
    s = run_http(server.url, dataset, num_requests, concurrency)
    cpu = process_cpu_s(server.pid) - cpu
    return Run(
        tps=s.output_throughput,
        ttft_p50_ms=s.ttft_ms.percentiles["p50"],
        ttft_p95_ms=s.ttft_ms.percentiles["p95"],
        tpot_ms=s.tpot_ms.mean,
        cpu_s_per_1k=1000 * cpu / s.total_output_tokens,
    )


def greedy_text(server: Server, prompt: list[int]) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    answer.raise_for_status()
    return str(answer.json()["choices"][0]["text"])


def greedy_agreement(servers: list[Server]) -> tuple[int, int]:
    """(prompts on which every server's greedy text is the same, prompts)."""
    prompts = token_prompts(NUM_GREEDY_PROMPTS, PROMPT_LEN, seed=7)
    same = sum(len({greedy_text(s, p) for s in servers}) == 1 for p in prompts)
    return same, len(prompts)


def sweep(
    servers: list[Server], concurrencies: tuple[int, ...], rounds: int, tmp: Path
) -> dict[tuple[str, int], Run]:
    """Best run (by tok/s) per (server, concurrency), servers alternating within each round."""
    best: dict[tuple[str, int], Run] = {}
    for concurrency in concurrencies:
        num_requests = max(4, concurrency)
        for round_ in range(rounds):
            # Prompts of their own each round, the same for every server in it: no server has
            # seen them, so every TTFT is a prefill (the warm case is shared_prefix_ttft_ms's).
            # Reused across rounds, the second round's prompts were cached by both servers, and
            # which round was best decided whether a TTFT was a prefill or a cache hit.
            prompts = token_prompts(num_requests, PROMPT_LEN, seed=1000 * concurrency + round_)
            dataset = write_dataset(prompts, OUTPUT_LEN, tmp / f"c{concurrency}-r{round_}.jsonl")
            order = servers if round_ % 2 == 0 else servers[::-1]
            for server in order:
                run = measure(server, dataset, num_requests, concurrency)
                print(f"    {server.name} c={concurrency} round {round_ + 1}: {run.tps:.1f} "
                      f"tok/s, {run.cpu_s_per_1k:.1f} CPU-s/1k", flush=True)  # fmt: skip
                key = (server.name, concurrency)
                if key not in best or run.tps > best[key].tps:
                    best[key] = run
    return best


def shared_prefix_ttft_ms(server: Server, tmp: Path) -> float:
    """Median TTFT of 5 requests sharing a 1,000-token prefix, after one warmed it."""
    ids = corpus_ids()
    prefix = ids[:PREFIX_LEN]
    tails = [ids[PREFIX_LEN + 16 * i : PREFIX_LEN + 16 * (i + 1)] for i in range(6)]
    warm = write_dataset([prefix + tails[0]], 1, tmp / "warm.jsonl")
    run_http(server.url, warm, 1, 1)
    dataset = write_dataset([prefix + t for t in tails[1:]], 1, tmp / "prefix.jsonl")
    return run_http(server.url, dataset, 5, 1).ttft_ms.percentiles["p50"]


@contextmanager
def kvpilot(model: Path, name: str, *args: str) -> Iterator[Server]:
    flags = ["--max-model-len", str(CONTEXT), *args]
    env = {**os.environ}
    env.pop("OMP_NUM_THREADS", None)  # the defaults under test decide the threads
    with server_common.runtime_server(model, *flags, env=env) as (url, pid):
        yield Server(name, url, pid)


@contextmanager
def llama(gguf: Path, threads: int, label: str) -> Iterator[Server]:
    with llama_cpp_common.llama_server(gguf, MAX_NUM_SEQS, CONTEXT, threads) as (
        url,
        pid,
    ):
        yield Server(f"llama.cpp {label}", url, pid)


def engine_choices(server: Server) -> dict[str, Any]:
    return dict(httpx.get(f"{server.url}/version", timeout=10).json()["engine"])


@dataclass
class ModelResult:
    title: str
    names: list[str]
    best: dict[tuple[str, int], Run]
    concurrencies: tuple[int, ...]
    agreement: tuple[int, int]
    prefix_ttft: dict[str, float]
    choices: dict[str, Any]


def compare(
    title: str,
    servers: list[Server],
    concurrencies: tuple[int, ...],
    rounds: int,
    with_prefix: bool,
    with_peer: bool = True,
) -> ModelResult:
    """servers: kvpilot with its defaults, its peer (unless not with_peer), then any other
    kvpilot configuration."""
    print(f"==> {title}", flush=True)
    agreement = greedy_agreement(servers[:2]) if with_peer else (0, 0)
    print(f"    greedy outputs agree on {agreement[0]}/{agreement[1]} prompts", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        best = sweep(servers, concurrencies, rounds, Path(tmp))
        pair = servers[:2]
        prefix = {s.name: shared_prefix_ttft_ms(s, Path(tmp)) for s in pair} if with_prefix else {}
    names = [s.name for s in servers]
    choices = engine_choices(servers[0])
    return ModelResult(title, names, best, concurrencies, agreement, prefix, choices)


def model_table(result: ModelResult) -> str:
    """One row per concurrency and server; the ratio is output tok/s over the first server's."""
    header = ["concurrency", "server", "output tok/s", "vs " + result.names[0],
              "TTFT p50 / p95 (ms)", "TPOT (ms)", "server CPU-s per 1k tok"]  # fmt: skip
    rows = []
    for c in result.concurrencies:
        first = result.best[(result.names[0], c)]
        for name in result.names:
            run = result.best[(name, c)]
            rows.append([c, name, f"{run.tps:.1f}", f"{run.tps / first.tps:.2f}x",
                         f"{run.ttft_p50_ms:.0f} / {run.ttft_p95_ms:.0f}", f"{run.tpot_ms:.1f}",
                         f"{run.cpu_s_per_1k:.1f}"])  # fmt: skip
    same, total = result.agreement
    text = f"### {result.title}\n\n" + markdown_table(header, rows) + "\n\n"
    if total:
        text += f"Greedy outputs ({GREEDY_TOKENS} tokens) identical on {same} of {total} prompts."
    if result.prefix_ttft:
        parts = ", ".join(f"{name} {ms:.0f} ms" for name, ms in result.prefix_ttft.items())
        text += f" Shared-prefix TTFT (warm, {PREFIX_LEN}-token prefix, median of 5): {parts}."
    choices = result.choices
    text += (f" kvpilot chose: {choices['threads']} thread(s) ({choices['threads_source']}), "
             f"{choices['dtype']} compute, KV pool {choices['kv_cache_bytes'] / 2**20:.0f} "
             f"MiB ({choices['kv_cache_source']}).")  # fmt: skip
    return text + "\n"


def run_model(
    model: Path, label: str, args: argparse.Namespace, publish: Callable[[ModelResult], None]
) -> None:
    """Each comparison on `model`, handed to `publish` as soon as it is measured."""
    gguf = llama_cpp_common.ensure_gguf(model, "bf16") if args.peer else Path()
    is_compute_bound = model != MODEL
    with ExitStack() as stack:
        ours = stack.enter_context(kvpilot(model, "kvpilot defaults"))
        threads = int(engine_choices(ours)["threads"])
        servers = [ours]
        if args.peer:
            servers.append(stack.enter_context(llama(gguf, threads, "bf16 GGUF")))
        if is_compute_bound and args.previous_defaults:
            previous = kvpilot(model, "kvpilot previous defaults", *PREVIOUS_DEFAULTS)
            servers.append(stack.enter_context(previous))
        publish(compare(label, servers, args.concurrency, args.rounds, args.peer, args.peer))
    if is_compute_bound and args.int8 and args.peer:
        q8 = llama_cpp_common.ensure_gguf(model, "q8_0")
        int8 = kvpilot(model, "kvpilot int8", "--quantization", "int8")
        with int8 as ours, llama(q8, threads, "q8_0") as peer:
            title = f"{label}: kvpilot int8 vs llama.cpp q8_0"
            publish(compare(title, [ours, peer], INT8_CONCURRENCIES, args.rounds, False))


def report(results: list[ModelResult], args: argparse.Namespace) -> str:
    peer = (
        f"`--parallel {MAX_NUM_SEQS}` for llama-server with kvpilot's thread count for "
        "`--threads` and `--threads-batch`; llama-server is llama.cpp as vendored by "
        f"llama-cpp-python {llama_cpp_common.VERSION}, built with -DGGML_NATIVE=ON (Release)"
        if args.peer
        else f"previous defaults: `{' '.join(PREVIOUS_DEFAULTS)}`, what `serve` chose on CPU before"
    )
    intro = (
        f"Workload: token-id prompts of {PROMPT_LEN} tokens, {OUTPUT_LEN} output tokens "
        "(ignore_eos), greedy, `kvpilot bench` closed loop with max(4, concurrency) requests per "
        "run, new prompts each round (the same for both servers), so TTFT is a prefill that no "
        f"cache holds; the servers up side by side with {CONTEXT} tokens per sequence and "
        f"{MAX_NUM_SEQS} sequences (`--max-model-len {CONTEXT}` for kvpilot, otherwise its "
        f"defaults; {peer}); {args.rounds} rounds, the servers' order flipping each round, best "
        "round per server. Other processes share this machine's cores: compare within a table, "
        "not across runs.\n\n"
    )
    return intro + "\n".join(model_table(r) for r in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default="tiny,compute", help="comma-separated: tiny, compute")
    parser.add_argument("--concurrency", type=lambda t: tuple(int(c) for c in t.split(",")),
                        default=CONCURRENCIES)  # fmt: skip
    parser.add_argument("--no-int8", dest="int8", action="store_false")
    parser.add_argument(
        "--no-previous-defaults",
        dest="previous_defaults",
        action="store_false",
        help="leave out kvpilot with the CPU defaults before the machine-derived ones",
    )
    parser.add_argument(
        "--no-peer",
        dest="peer",
        action="store_false",
        help="kvpilot's configurations only (no llama.cpp build): the defaults vs the previous",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.peer:
        llama_cpp_common.ensure_server()
    models = {
        "tiny": (MODEL, "tiny-llama (4 M parameters)"),
        "compute": (compute_bound_llama(), "compute-bound random Llama (~237 M, bf16)"),
    }
    given = sys.argv[1:] if argv is None else argv
    command = "python -m bench.engine_peer" + (" " + " ".join(given) if given else "")
    results: list[ModelResult] = []

    def publish(result: ModelResult | None) -> None:
        """Rewrite the section with every comparison so far: a run cut short keeps its figures."""
        if result is not None:
            results.append(result)
        body = report(results, args)
        if result is not None:
            body += "\n(Run in progress, or stopped here: only the comparisons above ran.)\n"
        if args.peer:
            # A run of one model keeps its own section, so it does not replace the other's.
            suffix = "" if args.models == "tiny,compute" else "_" + args.models.replace(",", "_")
            title = "Engine vs llama.cpp llama-server (same CPU)"
            write_section("engine_peer" + suffix, title, command, body)
        else:
            write_section(
                "engine_defaults",
                "Engine: defaults from the machine vs the previous CPU defaults",
                command,
                body,
            )

    for name in args.models.split(","):
        model, label = models[name]
        run_model(model, label, args, publish)
    publish(None)
    print(report(results, args))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
