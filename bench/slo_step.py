"""A step from 1x to 4x load with a TTFT SLO in the spec, on the dev cluster (issue 33's goal).

    python -m bench.slo_step [--base-s 180] [--step-s 300] [--window-s 60] [--max-replicas 2]

Real runtime pods on the `local` pool, the operator reading the dev cluster's Prometheus, and the
chart's gateway in front (hack.closedloop.start_gateway, the set-up of the gateway e2e tests and
bench.gateway_scale_from_zero). In one run:

1. Capacity: one replica of a ModelDeployment of its own (autoscaling off), a closed loop of
   twice its batch slots through the gateway; its completions per second are the replica's
   capacity and its TTFT p95 (each request waits for a slot about once) sets the target: the
   smallest TTFT bucket bound at or above `--headroom` x that p95.
2. The step's ModelDeployment is applied with the SLO in its spec (builtin, 1..`--max-replicas`,
   scale-down held for the run) and, once it serves, an
   open-loop Poisson load of `--load-fraction` x capacity (1x) runs for `--base-s`, then four
   times that (4x: more than one replica serves) for `--step-s`. Replicas, readiness and each
   decision's reason (status.autoscaling.lastDecision) are polled every second.
3. Attainment per `--window-s` window from the runtime's `vllm:time_to_first_token_seconds`
   histogram in Prometheus (the operator's own `ttft_buckets_query`, evaluated at each window's
   end over the window) and from the client's TTFTs; cold starts are each new pod's creation to
   Ready. The SLO holds when every window that misses it overlaps one and the same cold start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import slo_step_common as step
from bench.report import markdown_table, write_section
from hack import closedloop
from hack.devcluster import DevCluster, procs
from kvpilot.contract import timestamps
from kvpilot.operator.autoscaling.metrics_reader import ttft_buckets_query
from kvpilot.runtime.bench import runner
from kvpilot.runtime.bench.client import Endpoint
from kvpilot.runtime.bench.stats import RequestResult
from kvpilot.runtime.bench.tokens import LocalTokenCounter
from kvpilot.runtime.bench.workload import synthetic_requests
from kvpilot.runtime.server.metrics import TTFT_BUCKETS

NAME = "tiny-slo-step"
# The capacity is measured on a ModelDeployment of its own (autoscaling off), deleted before the
# step's is applied: its requests would otherwise be in the step's arrival rates (the operator's
# 30 s and 2 min windows) and scale it up before the 1x load began.
CAPACITY_NAME = "tiny-slo-capacity"
NAMESPACE = "default"
SLOTS = 2  # serving.maxNumSeqs: a small batch, so one replica saturates at a modest rate
INPUT_LEN, OUTPUT_LEN = 32, 8  # short: on a shared CPU a decode step takes tenths of a second
CAPACITY_REQUESTS = 40
PERCENTILE = 95.0
FACTOR = 4.0
TINY = closedloop.REPO_ROOT / "models" / "tiny-llama"


@dataclass
class Sample:
    """The ModelDeployment as one poll saw it."""

    at: float
    replicas: int
    ready: int
    desired: int
    decision: str
    decided_at: str


@dataclass
class Run:
    """What the step produced, for the report."""

    capacity_per_s: float
    capacity_ttft_p95_s: float
    target_s: float
    rate_per_s: float
    started_at: float
    results: list[RequestResult]
    samples: list[Sample] = field(default_factory=list)
    pods: list[dict[str, Any]] = field(default_factory=list)
    load_before: float = 0.0
    load_after: float = 0.0


def requests(n: int, seed: int) -> list[Any]:
    counter = LocalTokenCounter(TINY)
    return synthetic_requests(n, input_len=INPUT_LEN, output_len=OUTPUT_LEN, range_ratio=0.0,
                              seed=seed, chat=False, counter=counter)  # fmt: skip


def drive(
    url: str, model: str, times: list[float] | None, n: int, concurrency: int | None, seed: int = 0
) -> list[RequestResult]:
    """Send `n` requests through the gateway: open loop at `times`, else a closed loop."""
    endpoint = Endpoint(url, model, ignore_eos=True)
    load = requests(n, seed)
    results, _ = asyncio.run(
        runner.run(
            endpoint,
            load,
            concurrency=concurrency,
            times=times,
            max_concurrency=None,
            timeout_s=300,
            progress=False,
        )
    )
    return results


def capacity(url: str) -> tuple[float, float]:
    """One replica's completions per second with its batch full, and its TTFT p95 (seconds)."""
    drive(
        url, CAPACITY_NAME, None, 2 * SLOTS, 2 * SLOTS
    )  # warm: the first requests after Ready are slower
    started = time.monotonic()
    results = drive(url, CAPACITY_NAME, None, CAPACITY_REQUESTS, 2 * SLOTS)
    elapsed = time.monotonic() - started
    ok = [r for r in results if r.success]
    if len(ok) < len(results):
        raise RuntimeError(f"{len(results) - len(ok)} capacity requests failed: {results[0].error}")
    p95 = statistics.quantiles([r.ttft for r in ok], n=20)[-1]
    return len(ok) / elapsed, p95


def slo_autoscaling(target_s: float, max_replicas: int, hold_s: int) -> dict[str, Any]:
    auto = closedloop.builtin_autoscaling(max_replicas, hold_s)
    auto["slo"] = {"ttftSeconds": target_s, "percentile": PERCENTILE}
    return auto


def patch_autoscaling(cluster: DevCluster, autoscaling: dict[str, Any]) -> None:
    patch = {"spec": {"autoscaling": autoscaling}}
    cluster.kubectl("patch", "modeldeployment", NAME, "--type=merge", "-p", json.dumps(patch))


def poll(cluster: DevCluster) -> Sample:
    status = closedloop.md_status(cluster, NAME)
    auto = status.get("autoscaling") or {}
    return Sample(
        at=time.time(),
        replicas=int(status.get("replicas") or 0),
        ready=int(status.get("readyReplicas") or 0),
        desired=int(auto.get("desiredReplicas") or 0),
        decision=str(auto.get("lastDecision") or ""),
        decided_at=str(auto.get("lastDecisionTime") or ""),
    )


def step_load(cluster: DevCluster, url: str, args: argparse.Namespace, run: Run) -> None:
    """The 1x -> 4x open loop in a thread, the ModelDeployment polled every second meanwhile."""
    times = step.step_arrivals(run.rate_per_s, args.base_s, FACTOR, args.step_s, args.seed)
    out: list[list[RequestResult]] = []
    worker = threading.Thread(  # a daemon: an interrupted run does not wait for its load
        target=lambda: out.append(drive(url, NAME, times, len(times), None, args.seed)),
        daemon=True,
    )
    run.started_at = time.time()
    worker.start()
    while worker.is_alive():
        run.samples.append(poll(cluster))
        worker.join(timeout=1.0)  # pacing the polls; the load ends the loop
    run.results = out[0]
    run.pods = closedloop.model_pods(cluster, NAME)


def wait_serving(url: str, model: str) -> None:
    if not procs.wait_for(lambda: drive(url, model, None, 1, 1)[0].success, 300, 2.0):
        raise RuntimeError(f"{model} did not answer through the gateway within 300 s")


def measure(args: argparse.Namespace) -> tuple[Run, list[tuple[step.Window, step.Share]]]:
    cluster = DevCluster(Path(tempfile.mkdtemp(prefix="kvpilot-slo-step-")) / "cluster")
    load_before = os.getloadavg()[0]
    try:
        cluster.up()
        fixed = {"mode": "off", "replicas": 1}
        url = closedloop.start_gateway(cluster, closedloop.tiny_llama(CAPACITY_NAME, SLOTS, fixed))
        wait_serving(url, CAPACITY_NAME)
        per_s, p95 = capacity(url)
        cluster.kubectl("delete", "modeldeployment", CAPACITY_NAME, "--wait=false")
        target = step.ttft_target(p95, args.headroom, TTFT_BUCKETS)
        run = Run(per_s, p95, target, args.load_fraction * per_s, 0.0, [])
        run.load_before = load_before
        hold_s = int(args.base_s + args.step_s + 300)  # no scale-down inside the run
        md = closedloop.tiny_llama(NAME, SLOTS, slo_autoscaling(target, args.max_replicas, hold_s))
        cluster.kubectl("apply", "-f", "-", input=json.dumps(md))
        wait_serving(url, NAME)
        step_load(cluster, url, args, run)
        time.sleep(3 * 2)  # three scrapes (2 s), so Prometheus has the last observations
        shares = prometheus_shares(
            cluster.prometheus_url, run, args.base_s + args.step_s, args.window_s
        )
        run.load_after = os.getloadavg()[0]
    finally:
        cluster.kubectl("delete", "modeldeployment", NAME, "--wait=false", check=False)
        closedloop.stop_zero_gateway(cluster, CAPACITY_NAME)
        cluster.down()
    return run, shares


def prometheus_shares(
    prometheus: str, run: Run, span_s: float, width_s: int
) -> list[tuple[step.Window, step.Share]]:
    """Each window's attainment from the TTFT histogram, the operator's query at its end."""
    found = []
    for window in step.split(step.Window(run.started_at, run.started_at + span_s), width_s):
        query = ttft_buckets_query(NAMESPACE, NAME, width_s)
        params = urllib.parse.urlencode({"query": query, "time": f"{window.end:.3f}"})
        with urllib.request.urlopen(f"{prometheus}/api/v1/query?{params}", timeout=10) as resp:
            vector = json.load(resp)["data"]["result"]
        found.append((window, step.histogram_share(vector, run.target_s, width_s)))
    return found


def client_requests(run: Run) -> list[step.ClientRequest]:
    return [step.ClientRequest(run.started_at + r.start, r.ttft if r.success else None)
            for r in run.results]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-s", type=float, default=180, help="seconds at 1x")
    parser.add_argument("--step-s", type=float, default=300, help="seconds at 4x")
    parser.add_argument("--window-s", type=int, default=60, help="attainment window")
    parser.add_argument("--max-replicas", type=int, default=2, help="the local pool: 2 nodes")
    parser.add_argument("--load-fraction", type=float, default=0.3, help="1x / capacity")
    parser.add_argument("--headroom", type=float, default=1.0, help="target / capacity TTFT p95")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run, shares = measure(args)
    body = report(args, run, shares)
    print(body)
    command = (
        f"python -m bench.slo_step --base-s {args.base_s:g} --step-s {args.step_s:g} "
        f"--window-s {args.window_s} --max-replicas {args.max_replicas} "
        f"--load-fraction {args.load_fraction:g} --headroom {args.headroom:g} --seed {args.seed}"
    )
    # A section per load (1x as a share of capacity): runs at different loads stand side by side.
    title = (
        f"A 1x -> 4x step with a TTFT SLO on the dev cluster, 1x = {args.load_fraction:g} x "
        "one replica's capacity (issue 33)"
    )
    write_section(f"slo_step-load{args.load_fraction:g}", title, command, body)
    return 0


# ---- the report ------------------------------------------------------------------------------


def report(args: argparse.Namespace, run: Run, shares: list[tuple[step.Window, step.Share]]) -> str:
    clients = client_requests(run)
    cold = step.cold_starts(run.pods, run.started_at)
    both = [(w, s, step.client_share(clients, w, run.target_s)) for w, s in shares]
    failed = sum(1 for r in run.results if not r.success)
    intro = (
        f"tiny-llama on the dev cluster's `local` pool (real runtime pods, processes on this "
        f"machine's {os.cpu_count()} CPU cores, which every replica, the two gateway pods, the "
        f"control plane, Prometheus and the load generator share), `serving.maxNumSeqs: {SLOTS}`, "
        f"{INPUT_LEN} prompt / {OUTPUT_LEN} output tokens, streamed through the chart's gateway. "
        f"Load average {run.load_before:.1f} before the run, {run.load_after:.1f} after.\n\n"
        f"Capacity of one replica (closed loop of {2 * SLOTS}, {CAPACITY_REQUESTS} requests): "
        f"{run.capacity_per_s:.2f} req/s, TTFT p95 {run.capacity_ttft_p95_s * 1000:.0f} ms. "
        f"SLO in the spec: `ttftSeconds: {run.target_s:g}`, `percentile: {PERCENTILE:g}` "
        f"(the smallest TTFT bucket bound at or above {args.headroom:g} x that p95). "
        f"1x = {run.rate_per_s:.2f} req/s ({args.load_fraction:g} x capacity) Poisson for "
        f"{args.base_s:g} s, then 4x = {FACTOR * run.rate_per_s:.2f} req/s for {args.step_s:g} s; "
        f"{len(run.results)} requests, {failed} failed. A request counts in the window in which "
        "its first token came (when the runtime observes its TTFT).\n\n"
    )
    return (
        intro + window_table(args, run, both, cold) + "\n\n" + verdicts(shares, both, cold)
        + "\n\n" + cold_table(run, cold) + "\n\n" + decision_table(run)
    )  # fmt: skip


def window_table(
    args: argparse.Namespace,
    run: Run,
    both: list[tuple[step.Window, step.Share, step.Share]],
    cold: list[step.Window],
) -> str:
    rows = []
    for window, prom, client in both:
        since = window.start - run.started_at
        load = "1x" if since + args.window_s <= args.base_s else "4x"
        ready = replicas_at(run.samples, window.end)
        starting = "yes" if any(window.overlaps(c) for c in cold) else ""
        rows.append([f"{since:.0f}-{window.end - run.started_at:.0f}", load, str(ready),
                     share_text(prom), share_text(client), starting])  # fmt: skip
    head = ["window s", "load", "ready replicas at end", "attainment, Prometheus histogram (req)",
            "attainment, client (req)", "cold start in window"]  # fmt: skip
    return markdown_table(head, rows)


def share_text(share: step.Share) -> str:
    if share.share is None:
        return "no requests"
    return f"{100 * share.share:.1f}% ({share.requests:.0f})"


def replicas_at(samples: list[Sample], moment: float) -> int:
    before = [s for s in samples if s.at <= moment]
    return before[-1].ready if before else 0


def verdicts(
    shares: list[tuple[step.Window, step.Share]],
    both: list[tuple[step.Window, step.Share, step.Share]],
    cold: list[step.Window],
) -> str:
    lines = []
    for side, pairs in (("Prometheus histogram", shares), ("client", [(w, c) for w, _, c in both])):
        found = step.verdict(pairs, cold, PERCENTILE)
        word = "held" if found.held else "did NOT hold"
        lines.append(
            f"- {side}: the SLO {word} except during at most one cold start: "
            f"{len(found.missed)} of {len(pairs)} windows missed p{PERCENTILE:g}, "
            f"{len(found.unexcused)} of them outside any cold start; "
            f"{found.cold_starts_used} cold start(s) overlapped a miss."
        )
    return "\n".join(lines)


def cold_table(run: Run, cold: list[step.Window]) -> str:
    rows = [[f"{c.start - run.started_at:.1f}", f"{c.end - run.started_at:.1f}",
             f"{c.end - c.start:.1f}"] for c in cold]  # fmt: skip
    head = ["new pod created, s from load start", "Ready, s", "cold start s"]
    unready = step.never_ready(run.pods, run.started_at)
    table = markdown_table(head, rows) if rows else "No new pod was Ready during the load."
    return table + (
        f"\n\n{unready} pod(s) created during the load never became Ready." if unready else ""
    )


def decision_table(run: Run) -> str:
    """The decisions where the count, the fleet or the kind of reason changed (a tick that only
    moves the figures in the reason is left out), from status.autoscaling.lastDecision."""
    rows, last = [], ("", -1, -1, -1)
    for sample in run.samples:
        kind = (step.reason_kind(sample.decision), sample.desired, sample.replicas, sample.ready)
        if not sample.decided_at or kind == last:
            continue
        last = kind
        at = timestamps.unix(sample.decided_at) - run.started_at
        rows.append([f"{at:.0f}", str(sample.desired), f"{sample.replicas}/{sample.ready}",
                     sample.decision.replace("|", "/")])  # fmt: skip
    head = ["decided, s from load start", "desired", "replicas/ready", "reason"]
    return markdown_table(head, rows)


if __name__ == "__main__":
    sys.exit(main())
