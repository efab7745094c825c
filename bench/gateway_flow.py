"""kvpilot-gateway flow control: what the fair queue costs (issue 36 item 2).

    .venv/bin/python -m bench.gateway_flow [--requests 256] [--rounds 4]

One real `kvpilot-runtime serve` replica of tiny-llama (`--max-num-seqs 32`) and two real
`kvpilot-gateway` processes in front of it with the same API key: one without flow control, and
one with `--max-in-flight-per-replica 32`, so the requests beyond the replica's batch wait in the
gateway's fair queue instead of the replica's own queue. `kvpilot bench` drives both with a
closed loop of 64 streamed clients (saturated: half of them wait at any time), then with one
client (low load: nothing waits), alternating (which goes first alternating too, each run with
prompts of its own); output tokens/s ratio and added TTFT p50, the rounds' medians. The replica
and the client share one core, the gateways the other (server_common.Cores says why).
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

BATCH, CONCURRENCY = 32, 64
KEY = "sk-bench-flow"
KEYS = {"keys": [{"key": KEY, "team": "bench"}], "teams": [{"name": "bench"}]}
ARMS = ("without flow control", "fair queue at the replica's batch")
LOADS = {"saturated": CONCURRENCY, "low load": 1}


def closed_loop(url: str, requests: int, clients: int, seed: int) -> Summary:
    return run_bench(url, "--num-prompts", str(requests), "--concurrency", str(clients),
                     "--input-len", "128", "--output-len", "32", "--ignore-eos", "--seed",
                     str(seed), "--api-key", KEY)  # fmt: skip


def measure(
    replica: str, cores: server_common.Cores, workdir: Path, requests: int, rounds: int
) -> dict[tuple[str, str], list[Summary]]:
    config = {"models": [{"name": "tiny", "backends": [replica]}], **KEYS}
    with ExitStack() as stack:
        with server_common.pinned(os.getpid(), cores.gateway):
            plain = stack.enter_context(server_common.gateway_server(config, workdir))
            flow = stack.enter_context(server_common.gateway_server(
                config, workdir, "--max-in-flight-per-replica", str(BATCH),
                "--max-queued-per-tenant", str(CONCURRENCY)))  # fmt: skip
        stack.enter_context(server_common.pinned(os.getpid(), cores.replica))  # the client
        urls = dict(zip(ARMS, (plain, flow), strict=True))
        for seed, url in enumerate(urls.values(), start=1000):  # warm-up: pools, full batches
            closed_loop(url, requests, CONCURRENCY, seed)
        runs: dict[tuple[str, str], list[Summary]] = {}
        for index in range(rounds):
            order = list(ARMS) if index % 2 == 0 else list(reversed(ARMS))
            for load, clients in LOADS.items():
                count = requests if clients > 1 else requests // 4
                for turn, arm in enumerate(order):
                    seed = 10 * index + 2 * clients + turn
                    runs.setdefault((arm, load), []).append(
                        closed_loop(urls[arm], count, clients, seed)
                    )
    return runs


def report(
    args: argparse.Namespace, cores: server_common.Cores, runs: dict[tuple[str, str], list[Summary]]
) -> str:
    def p50s(summaries: list[Summary]) -> list[float]:
        return [s.ttft_ms.percentiles["p50"] for s in summaries]

    def median_of(arm: str, load: str, figure: str) -> float:
        summaries = runs[(arm, load)]
        values = [s.output_throughput for s in summaries] if figure == "tok/s" else p50s(summaries)
        return statistics.median(values)

    plain, flow = ARMS
    ratio = median_of(flow, "saturated", "tok/s") / median_of(plain, "saturated", "tok/s")
    added = median_of(flow, "low load", "ttft") - median_of(plain, "low load", "ttft")
    rows = [[f"{arm}, {load}", ", ".join(f"{s.output_throughput:.1f}" for s in summaries),
             ", ".join(f"{p:.1f}" for p in p50s(summaries))]
            for (arm, load), summaries in runs.items()]  # fmt: skip
    loadavg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"Cores: {cores.words}. Load average of this machine when the run ended: {loadavg} "
        "(wall-clock figures swing from round to round; read the per-round columns before the "
        "ratio).\n\n"
        f"Flow control overhead: {args.requests} requests a round saturated ({CONCURRENCY} "
        f"clients in a closed loop against a replica batching {BATCH}), {args.requests // 4} at "
        "low load (one client), 128-token prompts, 32 output tokens (ignore_eos), streamed, one "
        "API key, one tiny-llama replica behind a gateway without flow control and one with "
        f"`--max-in-flight-per-replica {BATCH}` (the surplus waits in the gateway's fair queue, "
        f"not the replica's), {args.rounds} rounds, which goes first alternating; the ratio and "
        "the added TTFT compare the rounds' medians.\n\n"
        + markdown_table(["", "output tok/s", "TTFT p50 (ms)"], rows)
        + f"\n\nThroughput saturated, fair queue / without: {ratio:.2f}x (goal >= 0.95x)  \n"
        + f"Added TTFT p50 at low load: {added:.2f} ms (goal <= 2 ms)\n\n"
        "Shares per tenant and priority under a flood: bench.flow_tenants (`kvpilot bench "
        "--tenant`), below.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    limits = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(BATCH)]
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
    command = f"python -m bench.gateway_flow --requests {args.requests} --rounds {args.rounds}"
    write_section("gateway_flow", "Gateway: flow control (fair queue) overhead", command, body)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
