"""Priority under overload (issue 36): a low-priority tenant floods a replica at 3x its capacity;
a high-priority tenant at 10% of capacity keeps its TTFT p95 <= 1.5x its idle value.

    .venv/bin/python -m bench.server_priority [--num-high 30] [--max-num-seqs 8] [--no-fcfs]

One `kvpilot-runtime serve --scheduling-policy priority` (tiny-llama, float32 on CPU). Capacity
is measured first: a closed loop of max-num-seqs clients of the flood's requests (64-token
prompts, 64 output tokens, greedy, ignore_eos), in requests/s. Then, through `kvpilot bench`'s
client (runtime/bench): the high tenant alone (Poisson arrivals at 10% of capacity, 16 output
tokens, priority -1): its idle TTFT; then the same high tenant beside a low one (priority 10)
sending Poisson arrivals at 3x capacity from 5 s before the high tenant's first request, cut off
when the high tenant's last request is done. The same flood against an fcfs server (where both
tenants send priority 0; --no-fcfs skips it) shows what the policy changes. Token-id prompts of
random ids: nothing is shared, so the prefix cache does not flatter either side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import server_common
from bench.engine_common import MODEL
from bench.report import markdown_table, write_section
from kvpilot.runtime.bench.client import Endpoint
from kvpilot.runtime.bench.runner import run
from kvpilot.runtime.bench.stats import Distribution, RequestResult
from kvpilot.runtime.bench.workload import BenchRequest

PROMPT_LEN = 64
FLOOD_OUTPUT = 64
HIGH_OUTPUT = 16
LOW, HIGH = 10, -1
FLOOD_FACTOR = 3.0
HIGH_SHARE = 0.1
FLOOD_HEAD_START_S = 5.0  # the flood builds a queue before the first high request
PROMPT_IDS = (
    16,
    4000,
)  # token ids drawn from tiny-llama's 4096-entry vocabulary, specials left out
GOAL = 1.5  # high tenant's TTFT p95 under the flood / idle
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class PriorityEndpoint(Endpoint):
    """`kvpilot bench`'s endpoint, sending vLLM's `priority` field too."""

    priority: int = 0

    def payload(self, request: BenchRequest) -> dict[str, Any]:
        return {**super().payload(request), "priority": self.priority}


def token_requests(n: int, max_tokens: int, rng: random.Random) -> list[BenchRequest]:
    return [
        BenchRequest(
            [rng.randrange(*PROMPT_IDS) for _ in range(PROMPT_LEN)], max_tokens, PROMPT_LEN
        )
        for _ in range(n)
    ]


def poisson_times(n: int, rate: float, rng: random.Random, start: float = 0.0) -> list[float]:
    times, at = [], start
    for _ in range(n):
        at += rng.expovariate(rate)
        times.append(at)
    return times


def endpoint(url: str, priority: int) -> PriorityEndpoint:
    return PriorityEndpoint(url, "tiny", temperature=0.0, ignore_eos=True, priority=priority)


async def send_all(
    ep: Endpoint, requests: list[BenchRequest], times: list[float] | None, concurrency: int | None
) -> tuple[list[RequestResult], float]:
    """`kvpilot bench`'s runner: a closed loop of `concurrency` clients, or open-loop `times`."""
    return await run(ep, requests, concurrency=concurrency, times=times, max_concurrency=None,
                     timeout_s=TIMEOUT_S, progress=False)  # fmt: skip


async def capacity(url: str, max_num_seqs: int, rng: random.Random, rounds: int = 3) -> float:
    """Requests/s of the flood's shape with every seat busy (a closed loop of max_num_seqs)."""
    requests = token_requests(rounds * max_num_seqs, FLOOD_OUTPUT, rng)
    results, wall_s = await send_all(endpoint(url, 0), requests, None, max_num_seqs)
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} capacity requests failed: {failed[:3]}")
    return len(results) / wall_s


async def high_tenant(
    url: str, priority: int, requests: list[BenchRequest], times: list[float]
) -> list[RequestResult]:
    results, _ = await send_all(endpoint(url, priority), requests, times, None)
    return results


async def beside_flood(
    url: str,
    priorities: tuple[int, int],
    high: list[BenchRequest],
    high_times: list[float],
    flood_rate: float,
    rng: random.Random,
) -> list[RequestResult]:
    """The high tenant's results with the flood running; the flood is cut off (its requests
    aborted) once the high tenant is done."""
    num_flood = int(flood_rate * (high_times[-1] + FLOOD_HEAD_START_S + 30))
    flood = token_requests(num_flood, FLOOD_OUTPUT, rng)
    flood_times = poisson_times(num_flood, flood_rate, rng)
    flooding = asyncio.create_task(send_all(endpoint(url, priorities[1]), flood, flood_times, None))
    shifted = [t + FLOOD_HEAD_START_S for t in high_times]
    try:
        return await high_tenant(url, priorities[0], high, shifted)
    finally:
        flooding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flooding


def priority_preemptions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvpilot_preemptions_by_reason_total" and s.labels["reason"] == "priority"
    )


@contextlib.contextmanager
def server(policy: str, max_num_seqs: int) -> Iterator[str]:
    args = ["--max-model-len", "512", "--max-num-seqs", str(max_num_seqs), "--dtype", "float32",
            "--scheduling-policy", policy, "--max-waiting", "4096"]  # fmt: skip
    with server_common.runtime_server(MODEL, *args) as (url, _pid):
        yield url


def ttft(results: list[RequestResult]) -> Distribution:
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} high-priority requests failed: {failed[:3]}")
    return Distribution.of([r.ttft for r in results], (50.0, 95.0))


def measure(args: argparse.Namespace) -> tuple[float, dict[str, Distribution], float]:
    rng = random.Random(0)
    high = token_requests(args.num_high, HIGH_OUTPUT, rng)
    found: dict[str, Distribution] = {}
    with server("priority", args.max_num_seqs) as url:
        asyncio.run(capacity(url, args.max_num_seqs, random.Random(1), rounds=1))  # warm-up
        rate = asyncio.run(capacity(url, args.max_num_seqs, random.Random(2)))
        times = poisson_times(args.num_high, HIGH_SHARE * rate, random.Random(3))
        found["idle"] = ttft(asyncio.run(high_tenant(url, HIGH, high, times)))
        flooded = beside_flood(url, (HIGH, LOW), high, times, FLOOD_FACTOR * rate, random.Random(4))
        found["priority"] = ttft(asyncio.run(flooded))
        preemptions = priority_preemptions(url)
    if not args.fcfs:
        return rate, found, preemptions
    with server("fcfs", args.max_num_seqs) as url:
        asyncio.run(capacity(url, args.max_num_seqs, random.Random(1), rounds=1))  # warm-up
        flooded = beside_flood(url, (0, 0), high, times, FLOOD_FACTOR * rate, random.Random(4))
        found["fcfs"] = ttft(asyncio.run(flooded))
    return rate, found, preemptions


def report(args: argparse.Namespace, rate: float, found: dict[str, Distribution],
           preemptions: float) -> str:  # fmt: skip
    idle_p95 = found["idle"].percentiles["p95"]
    labels = {
        "idle": "high tenant alone (priority server)",
        "priority": "beside the flood, --scheduling-policy priority",
        "fcfs": "beside the flood, fcfs (both priority 0)",
    }
    rows = [
        [labels[name], f"{d.percentiles['p50']:.0f}", f"{d.percentiles['p95']:.0f}",
         f"{d.percentiles['p95'] / idle_p95:.2f}x"]
        for name, d in found.items()
    ]  # fmt: skip
    ratio = found["priority"].percentiles["p95"] / idle_p95
    verdict = "met" if ratio <= GOAL else "NOT met"
    return (
        f"Capacity: {rate:.2f} requests/s ({PROMPT_LEN}-token prompts, {FLOOD_OUTPUT} output "
        f"tokens, `--max-num-seqs {args.max_num_seqs}`, tiny-llama float32 on CPU). The flood "
        f"sends {FLOOD_FACTOR:.0f}x that (Poisson, priority {LOW}); the high tenant "
        f"{args.num_high} requests at {HIGH_SHARE:.0%} of it (Poisson, {HIGH_OUTPUT} output "
        f"tokens, priority {HIGH}). Client and server share this machine's cores.\n\n"
        + markdown_table(["high tenant", "TTFT p50 (ms)", "TTFT p95 (ms)", "p95 / idle"], rows)
        + f"\n\nGoal TTFT p95 <= {GOAL}x idle under the flood: **{verdict}** ({ratio:.2f}x); "
        f"{preemptions:.0f} priority preemptions on the priority server.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-high", type=int, default=30)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument(
        "--fcfs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the flood against an fcfs server (the comparison; --no-fcfs skips it)",
    )
    args = parser.parse_args(argv)
    rate, found, preemptions = measure(args)
    body = report(args, rate, found, preemptions)
    print(body)
    command = (
        f"python -m bench.server_priority --num-high {args.num_high} "
        f"--max-num-seqs {args.max_num_seqs}{'' if args.fcfs else ' --no-fcfs'}"
    )
    write_section("server_priority", "Runtime: priority under a 3x flood", command, body)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
