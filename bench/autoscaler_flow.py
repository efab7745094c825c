"""kvpilot's policy behind a gateway with flow control, with and without the gateway's signal
(issue 33); writes its section of docs/benchmarks.md.

With `--max-in-flight-per-replica` the gateway keeps at most that many requests per replica in
flight and queues the rest in its fair queue: the replicas report few waiting requests and
receive only as fast as they serve. The simulator models that (`Settings.
max_in_flight_per_replica`, the limit at the replica's batch limit as docs/architecture.md
§3.7.3 advises), and each kvpilot policy runs twice on the same traces: reading the gateway's
fair queue and arrivals as the metrics reader now does ("gateway"), and reading the replicas
alone as it did before ("replicas only"). The oracle and the same policies without flow control
give the scale.

    .venv/bin/python -m bench.autoscaler_flow [--seeds 0,1,2] [--traces burst,...] [--jobs 2]
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from bench.autoscaler_sim import SLO_PERCENTILE, TRACES, TTFT_SLO_S
from bench.report import markdown_table, write_section
from kvpilot.operator.autoscaling.simulator import policies, traces
from kvpilot.operator.autoscaling.simulator.capacity import CapacityModel
from kvpilot.operator.autoscaling.simulator.cluster import Policy, Settings, simulate
from kvpilot.operator.autoscaling.simulator.report import initial_replicas, summarise

# (row name, policy, its SLO, reads the gateway's signal, flow control on)
VARIANTS = (
    ("kvpilot, gateway", "kvpilot", False, True, True),
    ("kvpilot, replicas only", "kvpilot", False, False, True),
    ("kvpilot_slo, gateway", "kvpilot_slo", True, True, True),
    ("kvpilot_slo, replicas only", "kvpilot_slo", True, False, True),
    ("oracle", "oracle", False, True, True),
    ("kvpilot_slo, no flow control", "kvpilot_slo", True, True, False),
)


def build(variant: tuple[str, str, bool, bool, bool], trace: traces.Trace,
          capacity: CapacityModel, settings: Settings) -> Policy:  # fmt: skip
    row, name, slo, signal, _ = variant
    bounds = policies.user_bounds(settings.min_replicas, settings.max_replicas,
                                  TTFT_SLO_S if slo else None, SLO_PERCENTILE)  # fmt: skip
    if name == "oracle":
        return policies.Oracle(trace, capacity, settings)
    prior = policies.planner_seed(capacity) if slo else None
    return policies.KvpilotPolicy(bounds, prior, name=row, gateway_signal=signal)


def run_one(trace_name: str, seed: int, variant: tuple[str, str, bool, bool, bool]
            ) -> dict[str, Any]:  # fmt: skip
    capacity, trace = CapacityModel(), traces.build(trace_name, seed)
    limit = capacity.max_num_seqs if variant[4] else None
    base = Settings(min_replicas=1, max_replicas=16, max_in_flight_per_replica=limit)
    settings = replace(base, initial_replicas=initial_replicas(trace, capacity, base))
    result = simulate(trace, build(variant, trace, capacity, settings), capacity, settings)
    return {"trace": trace_name, "seed": seed, "variant": variant[0],
            **summarise(result, TTFT_SLO_S)}  # fmt: skip


def rows(runs: list[dict[str, Any]], seeds: list[int]) -> list[list[object]]:
    """Per trace and variant: attainment (mean, and per seed), GPU-hours against the oracle's on
    the same seed, p95 TTFT; the mean over seeds."""
    by = {(r["trace"], r["seed"], r["variant"]): r for r in runs}
    table: list[list[object]] = []
    for trace in dict.fromkeys(r["trace"] for r in runs):
        for variant in (v[0] for v in VARIANTS):
            mine = [by[trace, s, variant] for s in seeds]
            ratio = [
                m["gpu_hours"] / by[trace, s, "oracle"]["gpu_hours"]
                for m, s in zip(mine, seeds, strict=True)
            ]
            slo = [m["slo_attainment"] for m in mine]
            table.append([
                trace, variant, f"{100 * statistics.mean(slo):.2f}%",
                " / ".join(f"{100 * v:.1f}" for v in slo),
                f"{statistics.mean(ratio):.2f}x",
                f"{statistics.mean(m['ttft_p95_s'] for m in mine):.2f}",
            ])  # fmt: skip
    return table


HEADER = ["trace", "policy", "SLO attainment", "per seed (%)", "GPU-h vs oracle", "p95 TTFT (s)"]


def body(runs: list[dict[str, Any]], seeds: list[int]) -> str:
    capacity = CapacityModel()
    return f"""
The traces of `autoscaler_sim` (seeds {", ".join(map(str, seeds))}), replicas 1..16, TTFT SLO \
{TTFT_SLO_S:g} s, the same capacity model; flow control at the gateway with \
{capacity.max_num_seqs} requests in flight per replica (the batch limit), the rest in one \
first-come-first-served queue (one tenant; unbounded: no refusal, no deadline). "gateway": the \
policy reads the fair queue's depth as waiting demand and the larger of the gateway's and the \
replicas' arrival rates (`metrics_reader.arrivals_seen`), as the operator now does; "replicas \
only": the replicas' waiting count and received rate alone, as before. The oracle and the last \
row (the SLO policy with no flow control) give the scale. GPU-hours are against the oracle under \
flow control on the same seed, averaged over the seeds.

{markdown_table(HEADER, rows(runs, seeds))}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated")
    parser.add_argument("--traces", default=",".join(TRACES), help="comma-separated")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.traces.split(",")
    work = [(t, s, v) for t in names for s in seeds for v in VARIANTS]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(run_one, *zip(*work, strict=True)))
    command = "python -m bench.autoscaler_flow"
    if args.seeds != "0,1,2":
        command += f" --seeds {args.seeds}"
    if args.traces != ",".join(TRACES):
        command += f" --traces {args.traces}"
    text = body(runs, seeds)
    write_section("autoscaler_flow", "Autoscaling behind the gateway's flow control", command,
                  text)  # fmt: skip
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
