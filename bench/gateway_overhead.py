"""kvpilot-gateway: what the proxy adds to a request, gateway vs straight to the replica.

    .venv/bin/python -m bench.gateway_overhead [--requests 256] [--rounds 5] [--pairs 256]

One real `kvpilot-runtime serve` replica of tiny-llama and a real `kvpilot-gateway` process in
front of it (static config, prefix affinity); streamed completions of 128-token prompts, TTFT
measured at the client to the first content chunk:
(a) Alone: one request at a time (4 output tokens), in pairs, one straight to the replica and one
through the gateway, the order alternating from pair to pair. The median of the pairs'
differences is the gateway's own latency, free of what a busy replica adds to both.
(b) Pairs under load: 64 clients in a closed loop (32 output tokens, ignore_eos) whose requests
go straight to the replica and through the gateway by turns, so both halves meet the same
batches; TTFT p50 of each half. Separate direct and gateway runs differ from round to round by
far more than the gateway adds (the replica's batches form differently each time).
(c) Throughput: the same closed loop (`kvpilot bench`), all direct or all through, alternating
for a few rounds (which goes first alternating too); output tokens/s, the rounds' medians.

Where the machine has two cores or more, the replica and the client run on one and the gateway on
the others (server_common.Cores says why).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench import server_common
from bench.gateway_routing import MODEL, gateway, p50, run_bench, text_pool
from bench.report import markdown_table, write_section
from kvpilot.runtime.bench.stats import Summary

CONCURRENCY = 64
TTFT_COLUMNS = ["", "(a) TTFT p50 alone (ms)", "(b) TTFT p50 under load (ms)",
                "(b) TTFT p95 under load (ms)"]  # fmt: skip
PROMPT_WORDS = 96  # ~128 tiny-llama tokens of pydoc text
LIMITS = ["--max-model-len", "2048", "--max-num-seqs", "64", "--dtype", "float32"]


@dataclass(frozen=True)
class Pairs:
    direct: list[float]  # TTFT ms of each pair's direct request
    through: list[float]  # and of its request through the gateway

    def differences(self) -> list[float]:
        return [t - d for d, t in zip(self.direct, self.through, strict=True)]


@dataclass(frozen=True)
class Overhead:
    alone: Pairs  # one pair at a time
    loaded: Pairs  # pairs under load
    direct: list[Summary]  # per round, under load
    through: list[Summary]
    cores: str  # how the cores were split, in words for the report


def prompts(count: int, tag: str) -> list[str]:
    """`count` distinct prompts of about equal length, each opening with its own tag (`tag` and
    its number), so no request finds another's prefix cached, in this part or any other."""
    words = text_pool()
    starts = range(0, len(words) - PROMPT_WORDS, PROMPT_WORDS)
    return [f"{tag} {i}: " + " ".join(words[start : start + PROMPT_WORDS])
            for i, start in zip(range(count), itertools.cycle(starts))]  # fmt: skip


async def measure_alone(replica: str, gateway_url: str, pairs: int) -> Pairs:
    texts = prompts(2 * pairs + 8, "alone")
    alone = Pairs([], [])
    async with httpx.AsyncClient(timeout=120) as client:

        async def ttft(url: str, text: str) -> float:
            return await streamed_ttft_ms(client, url, text, max_tokens=4)

        for text in texts[:8]:  # warm-up: connections and the first requests' one-off costs
            await ttft(replica, text), await ttft(gateway_url, text)
        for i in range(pairs):
            a, b = texts[8 + 2 * i], texts[9 + 2 * i]
            if i % 2:  # alternate which goes first and which prompt each gets
                alone.through.append(await ttft(gateway_url, a))
                alone.direct.append(await ttft(replica, b))
            else:
                alone.direct.append(await ttft(replica, a))
                alone.through.append(await ttft(gateway_url, b))
    return alone


async def paired_load(replica: str, gateway_url: str, texts: list[str]) -> Pairs:
    """`texts` in pairs from CONCURRENCY / 2 closed-loop clients, each sending a pair's two at
    once, one straight to the replica and one through the gateway: the two arrive together and
    meet the same batches, so their TTFT difference is the gateway's share (a difference of two
    separate samples' medians has a sampling error of several ms at this load)."""
    pairs, queue = Pairs([], []), list(zip(texts[::2], texts[1::2], strict=False))
    limits = httpx.Limits(max_connections=2 * CONCURRENCY)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def worker() -> None:
            while queue:
                a, b = queue.pop(0)
                direct, through = await asyncio.gather(
                    streamed_ttft_ms(client, replica, a), streamed_ttft_ms(client, gateway_url, b)
                )
                pairs.direct.append(direct)
                pairs.through.append(through)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY // 2)))
    return pairs


async def streamed_ttft_ms(
    client: httpx.AsyncClient, base_url: str, prompt: str, max_tokens: int = 32
) -> float:
    """TTFT of one streamed completion; the stream is read to its end so the connection is
    kept for the next request."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    first: float | None = None
    started = time.perf_counter()
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"no token came back from {base_url}")
    return (first - started) * 1000


def loaded_run(url: str, num_requests: int, seed: int) -> Summary:
    """`kvpilot bench`'s random prompts, new ones for every `seed`: a round must not find the
    last one's prompts in the prefix cache."""
    return run_bench(url, "--seed", str(seed), "--num-prompts", str(num_requests),
                     "--concurrency", str(CONCURRENCY), "--input-len", "128", "--output-len",
                     "32", "--ignore-eos")  # fmt: skip


def measure(workdir: Path, num_requests: int, rounds: int, pairs: int) -> Overhead:
    cores = server_common.split_cores()
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores.replica))}
    with contextlib.ExitStack() as stack:
        replica, pid = stack.enter_context(server_common.runtime_server(MODEL, *LIMITS, env=env))
        stack.enter_context(server_common.pinned(pid, cores.replica))
        with server_common.pinned(os.getpid(), cores.gateway):  # the gateway starts there
            url = stack.enter_context(gateway([replica], "prefix", workdir))
        stack.enter_context(server_common.pinned(os.getpid(), cores.replica))  # the client
        alone = asyncio.run(measure_alone(replica, url, pairs))
        for seed, warm_up in enumerate((replica, url), start=1000):  # the replica's first full
            loaded_run(warm_up, num_requests, seed)  # batches, the gateway's connection pool
        texts = prompts(rounds * num_requests, "loaded")
        loaded = asyncio.run(paired_load(replica, url, texts))
        direct, through = [], []
        for index in range(rounds):  # which goes first alternates, as in measure_alone
            first, second = (replica, url) if index % 2 == 0 else (url, replica)
            runs = {target: loaded_run(target, num_requests, 2 * index + turn)
                    for turn, target in enumerate((first, second))}  # fmt: skip
            direct.append(runs[replica])
            through.append(runs[url])
    return Overhead(alone, loaded, direct, through, cores.words)


def report(args: argparse.Namespace, overhead: Overhead) -> str:
    alone, loaded = overhead.alone.differences(), overhead.loaded.differences()
    ratio = (statistics.median(s.output_throughput for s in overhead.through)
             / statistics.median(s.output_throughput for s in overhead.direct))  # fmt: skip
    ttft_rows = [[name, f"{statistics.median(getattr(overhead.alone, side)):.2f}",
                  f"{statistics.median(getattr(overhead.loaded, side)):.1f}",
                  f"{percentile(getattr(overhead.loaded, side), 0.95):.1f}"]
                 for name, side in (("direct to the replica", "direct"),
                                    ("through the gateway", "through"))]  # fmt: skip
    rows = [[name, ", ".join(f"{s.output_throughput:.1f}" for s in runs),
             ", ".join(f"{p50(s):.1f}" for s in runs)]
            for name, runs in (("direct to the replica", overhead.direct),
                               ("through the gateway", overhead.through))]  # fmt: skip
    return (
        f"Cores: {overhead.cores}. Streamed completions of 128-token prompts; TTFT at the "
        "client.\n\n"
        f"(a) alone: {args.pairs} pairs of one request each (4 output tokens), direct and "
        "through the gateway back to back, the order alternating; (b) under load: "
        f"{len(loaded)} pairs (32 output tokens, ignore_eos) from {CONCURRENCY // 2} clients in "
        f"a closed loop, each sending a pair's two requests at once ({CONCURRENCY} in flight), "
        "one direct and one through the gateway, so both meet the same batches.\n\n"
        + markdown_table(TTFT_COLUMNS, ttft_rows)
        + "\n\nAdded TTFT, the median of the pairs' differences (goal <= 2 ms): alone "
        f"{statistics.median(alone):.2f} ms (quartiles {quartiles(alone)}), under load "
        f"{statistics.median(loaded):.2f} ms (quartiles {quartiles(loaded)})\n\n"
        f"(c) Throughput: {args.requests} requests a round, the same closed loop all direct or "
        f"all through the gateway (`kvpilot bench`), {args.rounds} rounds, which goes first "
        "alternating (per-round figures: rounds differ by more than the gateway adds, which "
        "is why (b) pairs requests).\n\n"
        + markdown_table(["", "output tok/s", "TTFT p50 (ms)"], rows)
        + f"\n\nThroughput through the gateway / direct, the rounds' medians: {ratio:.2f}x "
        "(goal >= 0.95x)\n"
    )


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def quartiles(values: list[float]) -> str:
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"{q1:.2f} to {q3:.2f} ms"


def parse_cli(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=256, help="per round under load")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=256, help="one request at a time")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_cli(argv)
    with tempfile.TemporaryDirectory() as tmp:
        overhead = measure(Path(tmp), args.requests, args.rounds, args.pairs)
    body = report(args, overhead)
    print(body)
    command = (f"python -m bench.gateway_overhead --requests {args.requests} --rounds "
               f"{args.rounds} --pairs {args.pairs}")  # fmt: skip
    write_section("gateway_overhead", "Gateway: what the proxy adds", command, body)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
