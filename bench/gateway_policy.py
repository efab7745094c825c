"""kvpilot-gateway policies: what API keys and budgets in Redis cost in throughput.

    .venv/bin/python -m bench.gateway_policy [--requests 256] [--rounds 4]

One real `kvpilot-runtime serve` replica of tiny-llama, a real redis-server and two real
`kvpilot-gateway` processes in front of the replica: a plain one, and one with an API key whose
budget (total tokens per day, requests per minute, and its team's total tokens per day: three
counters reserved and settled per request) lives in Redis. `kvpilot bench` drives both with the
same closed loop of 64 streamed clients, alternating (which goes first alternating too, each run
with prompts of its own so none finds another's in the prefix cache); output tokens/s ratio and
added TTFT p50, the rounds' medians. The replica and the client share one core, the gateways and
Redis the other (server_common.Cores says why). (The response cache has its own module.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench import server_common
from bench.gateway_routing import MAX_MODEL_LEN, MODEL, run_bench
from bench.report import markdown_table, write_section
from kvpilot.runtime.bench.stats import Summary

CONCURRENCY = 64
KEY = "sk-bench-budget"
BUDGET_KEYS = {
    "keys": [{"key": KEY, "team": "bench", "rpm_limit": 1_000_000,
              "limits": [{"unit": "total_tokens", "limit": 10**12, "window": "1d"}]}],
    "teams": [{"name": "bench", "limits": [{"unit": "total_tokens", "limit": 10**12,
                                            "window": "1d"}]}],
}  # fmt: skip


def closed_loop(url: str, requests: int, seed: int, *extra: str) -> Summary:
    return run_bench(url, "--num-prompts", str(requests), "--concurrency", str(CONCURRENCY),
                     "--input-len", "128", "--output-len", "32", "--ignore-eos", "--seed",
                     str(seed), *extra)  # fmt: skip


def measure(
    replica: str, cores: server_common.Cores, workdir: Path, requests: int, rounds: int
) -> dict[str, list[Summary]]:
    models = {"models": [{"name": "tiny", "backends": [replica]}]}
    with ExitStack() as stack:
        with server_common.pinned(os.getpid(), cores.gateway):  # Redis and the gateways
            # appendonly, as README.md says to run the budget store (spend survives a restart).
            redis_url = stack.enter_context(
                server_common.redis_server(workdir, "--appendonly", "yes")
            )
            plain = stack.enter_context(server_common.gateway_server(models, workdir))
            budgeted = stack.enter_context(
                server_common.gateway_server(
                    {**models, **BUDGET_KEYS}, workdir, "--redis-url", redis_url
                )
            )
        stack.enter_context(server_common.pinned(os.getpid(), cores.replica))  # the client
        arms = {"plain gateway": (plain,), "keys + budgets in Redis": (budgeted, "--api-key", KEY)}
        for seed, (url, *extra) in enumerate(arms.values(), start=1000):  # warm-up: the pools,
            closed_loop(url, requests, seed, *extra)  # the replica's first full batches
        runs: dict[str, list[Summary]] = {name: [] for name in arms}
        for index in range(rounds):
            order = list(arms) if index % 2 == 0 else list(reversed(arms))
            for turn, name in enumerate(order):
                url, *extra = arms[name]
                runs[name].append(closed_loop(url, requests, 2 * index + turn, *extra))
    return runs


def report(
    args: argparse.Namespace, cores: server_common.Cores, runs: dict[str, list[Summary]]
) -> str:
    def p50s(summaries: list[Summary]) -> list[float]:
        return [s.ttft_ms.percentiles["p50"] for s in summaries]

    plain, budgeted = runs["plain gateway"], runs["keys + budgets in Redis"]
    ratio = (statistics.median(s.output_throughput for s in budgeted)
             / statistics.median(s.output_throughput for s in plain))  # fmt: skip
    added = statistics.median(p50s(budgeted)) - statistics.median(p50s(plain))
    rows = [[name, ", ".join(f"{s.output_throughput:.1f}" for s in summaries),
             ", ".join(f"{p:.1f}" for p in p50s(summaries))]
            for name, summaries in runs.items()]  # fmt: skip
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"Cores: {cores.words}. Load average of this machine when the run ended: {load} "
        "(wall-clock figures swing from round to round; read the per-round columns before the "
        "ratio).\n\n"
        f"Budget overhead: {args.requests} requests, 128-token prompts, 32 output tokens "
        f"(ignore_eos), {CONCURRENCY} clients in a closed loop, streamed, one tiny-llama replica "
        "behind a plain gateway and behind a gateway with an API key, two token limits and a "
        "request limit (three Redis counters reserved and settled per request, the stream's "
        f"usage asked upstream and stripped again), alternating for {args.rounds} rounds, which "
        "goes first alternating; the ratio and the added TTFT compare the rounds' medians.\n\n"
        + markdown_table(["", "output tok/s", "TTFT p50 (ms)"], rows)
        + f"\n\nThroughput with budgets / without: {ratio:.2f}x (goal >= 0.95x)  \n"
        + f"Added TTFT p50: {added:.1f} ms\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    limits = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(CONCURRENCY)]
    cores = server_common.split_cores()
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores.replica))}
    with (
        tempfile.TemporaryDirectory() as tmp,
        server_common.runtime_server(MODEL, *limits, env=env) as (replica, pid),
        server_common.pinned(pid, cores.replica),
    ):
        runs = measure(replica, cores, Path(tmp), args.requests, args.rounds)
    body = report(args, cores, runs)
    print(body)
    command = f"python -m bench.gateway_policy --requests {args.requests} --rounds {args.rounds}"
    write_section("gateway_policy", "Gateway: API keys and budgets in Redis", command, body)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
