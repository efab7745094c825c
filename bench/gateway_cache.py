"""kvpilot-gateway's response cache: hit rate and hit TTFT on a workload with 50% repeats.

    .venv/bin/python -m bench.gateway_cache [--requests 400] [--concurrency 8]

One real `kvpilot-runtime serve` replica of tiny-llama (on a core of its own where there are two:
server_common.Cores) behind a real `kvpilot-gateway` with the cache on, once with the in-process
store and once with a Redis store (a real `redis-server` on a free port). The workload: streamed
completions at temperature 0; each request repeats an earlier prompt with probability 0.5 (one sent
at least 2 x concurrency requests before, so it has finished and been stored), else it is a new
prompt. TTFT is measured at the client: from sending the request to the first content chunk. Hit
rate = `x-kvpilot-cache: hit` answers / requests. The gateway's own time for a hit (its access
log's `duration_ms`: the request read to the replayed answer written) is reported beside it: what a
hit costs inside the gateway, without the client's and the shared CPU's share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench import server_common
from bench.gateway_routing import MODEL
from bench.report import markdown_table, write_section

REPEAT_SHARE = 0.5
OUTPUT_TOKENS = 32
WORDS = ["river", "stone", "lantern", "orchard", "violet", "harbour", "meadow", "copper",
         "signal", "winter", "garden", "thunder", "pocket", "marble", "cinder", "willow",
         "beacon", "saddle", "hollow", "ember"]  # fmt: skip


@dataclass(frozen=True)
class Result:
    state: str  # x-kvpilot-cache
    ttft_ms: float


def workload(num_requests: int, concurrency: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts: list[str] = []
    for index in range(num_requests):
        settled = index - 2 * concurrency  # prompts sent this long ago have been stored
        if settled > 0 and rng.random() < REPEAT_SHARE:
            prompts.append(prompts[rng.randrange(settled)])
        else:
            prompts.append(f"Request {index}: " + " ".join(rng.choices(WORDS, k=24)))
    return prompts


async def one(client: httpx.AsyncClient, url: str, prompt: str) -> Result:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    started = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:300]!r}")
        async for chunk in response.aiter_bytes():
            if ttft is None and b'"text"' in chunk:
                ttft = (time.perf_counter() - started) * 1000
    return Result(response.headers.get("x-kvpilot-cache", ""), ttft or float("nan"))


async def run(url: str, prompts: list[str], concurrency: int) -> list[Result]:
    queue = list(enumerate(prompts))
    results: list[Result | None] = [None] * len(prompts)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def worker() -> None:
            while queue:
                index, prompt = queue.pop(0)
                results[index] = await one(client, url, prompt)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None]


@contextmanager
def cached_gateway(
    backend: str, workdir: Path, store: str, redis_url: str
) -> Iterator[tuple[str, Path]]:
    """The URL of a gateway caching in `store` (memory or redis) and its log (access lines at
    info: one JSON line per request)."""
    config = {"models": [{"name": "tiny", "backends": [backend]}],
              "cache": {"enabled": True, "ttlSeconds": 3600}}  # fmt: skip
    flags = ("--cache-store", store, "--redis-url", redis_url, "--log-level", "info")
    log = workdir / f"gateway-{store}.log"
    with server_common.gateway_server(config, workdir, *flags, log=log) as url:
        yield url, log


def access_lines(log_path: Path) -> list[dict[str, object]]:
    lines = [line for line in log_path.read_text().splitlines() if line.startswith("{")]
    return [entry for entry in map(json.loads, lines) if entry.get("event") == "request"]


def hit_ms_in_gateway(lines: list[dict[str, object]]) -> list[float]:
    return [float(str(entry["duration_ms"])) for entry in lines if entry.get("cache") == "hit"]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


def row(
    store: str, results: list[Result], alone: list[Result], in_gateway: list[float]
) -> list[object]:
    hits = [r.ttft_ms for r in results if r.state == "hit"]
    alone_hits = [r.ttft_ms for r in alone if r.state == "hit"]
    misses = [r.ttft_ms for r in results if r.state == "miss"]
    return [store, len(results), f"{100 * len(hits) / len(results):.1f}%",
            f"{percentile(hits, 0.5):.2f}", f"{percentile(hits, 0.95):.2f}",
            f"{percentile(in_gateway, 0.5):.2f}", f"{percentile(in_gateway, 0.95):.2f}",
            f"{percentile(misses, 0.5):.1f}", f"{percentile(misses, 0.95):.1f}",
            f"{percentile(alone_hits, 0.5):.2f} ({len(alone_hits)}/{len(alone)} hits)"]  # fmt: skip


COLUMNS = ["store", "requests", "hit rate", "hit TTFT p50 (ms)", "hit TTFT p95 (ms)",
           "hit in the gateway p50 (ms)", "hit in the gateway p95 (ms)", "miss TTFT p50 (ms)",
           "miss TTFT p95 (ms)", "hit TTFT p50 alone (ms)"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alone", type=int, default=50,
                        help="stored prompts sent again one at a time")  # fmt: skip
    args = parser.parse_args(argv)
    limits = ["--max-model-len", "2048", "--max-num-seqs", "32"]
    rows: list[list[object]] = []
    cores = server_common.split_cores()
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores.replica))}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        replica, pid = stack.enter_context(server_common.runtime_server(MODEL, *limits, env=env))
        stack.enter_context(server_common.pinned(pid, cores.replica))
        stack.enter_context(server_common.pinned(os.getpid(), cores.replica))  # the client
        for store in ("memory", "redis"):
            prompts = workload(args.requests, args.concurrency, args.seed + len(rows))
            with ExitStack() as gateway_stack:
                with server_common.pinned(os.getpid(), cores.gateway):  # they start there
                    redis_url = gateway_stack.enter_context(server_common.redis_server(workdir))
                    url, log_path = gateway_stack.enter_context(
                        cached_gateway(replica, workdir, store, redis_url)
                    )
                mixed = asyncio.run(run(url, prompts, args.concurrency))
                in_gateway = hit_ms_in_gateway(access_lines(log_path))  # the mixed run's
                repeats = sorted(set(prompts))[: args.alone]  # all stored by now
                alone = asyncio.run(run(url, repeats, 1))
            rows.append(row(store, mixed, alone, in_gateway))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    body = (
        f"{args.requests} streamed completions (temperature 0, {OUTPUT_TOKENS} output tokens), "
        f"{args.concurrency} clients in a closed loop, each request a repeat of an earlier one "
        f"with probability {REPEAT_SHARE} (else a new ~30-token prompt); one tiny-llama replica "
        "behind the gateway; TTFT at the client to the first content chunk; a hit in the "
        "gateway: its access log's duration (request read to the stored answer written, "
        "rendered once when it was stored). Goals: hit rate ≈ 50%, hit TTFT p50 <= 5 ms. The "
        "last column: after the mixed run, "
        f"{args.alone} of its prompts sent again one at a time (hits with nothing else in "
        f"flight). Cores: {cores.words}. Load average when the run ended: {load} (other jobs "
        "on this machine compete for the same cores).\n\n" + markdown_table(COLUMNS, rows) + "\n"
    )
    print(body)
    command = (f"python -m bench.gateway_cache --requests {args.requests} --concurrency "
               f"{args.concurrency} --seed {args.seed} --alone {args.alone}")  # fmt: skip
    write_section("gateway_cache", "Gateway: response cache", command, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
