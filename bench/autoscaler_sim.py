"""Autoscaling policies compared in the simulator; writes its section of docs/benchmarks.md.

All policies run on the same traces in one run: a sharp step burst (1 h), a diurnal day (24 h),
Poisson spikes (2 h), steady Poisson load (2 h, for the flapping target) and a flash crowd (10x in
30 s, 1 h), each for seeds 0-4. kvpilot is the operator's own `policy.decide` with its default
settings; kvpilot_slo the same function given a TTFT SLO (issue 33). Plots and the full table
are for the first seed; the per-seed table has both kvpilot rows against every baseline.

    .venv/bin/python -m bench.autoscaler_sim [--seeds 0,1,2,3,4] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.report import markdown_table, write_section
from kvpilot.operator.autoscaling import policy, replica_capacity
from kvpilot.operator.autoscaling.simulator import policies, traces
from kvpilot.operator.autoscaling.simulator.capacity import CapacityModel
from kvpilot.operator.autoscaling.simulator.cluster import RunResult, Settings, simulate
from kvpilot.operator.autoscaling.simulator.report import (
    TABLE_HEADER,
    initial_replicas,
    plot,
    run_matrix,
    summarise_all,
    table_rows,
)
from kvpilot.operator.autoscaling.simulator.traces import Trace

TRACES = ("burst", "diurnal", "spikes", "steady", "flash")
BASELINES = ("hpa", "kubeai", "keda")
TTFT_SLO_S = 2.0
SLO_PERCENTILE = 99.0  # the attainment the issues target: 99% of requests within TTFT_SLO_S
OURS = ("kvpilot", "kvpilot_slo")
IMG = Path(__file__).resolve().parent.parent / "docs" / "img"

FULL_ORACLE = "oracle_at_100pct"

Summary = dict[str, dict[str, dict[str, Any]]]


def full_oracle(trace: Trace, capacity: CapacityModel, settings: Settings) -> RunResult:
    start = replace(settings, initial_replicas=initial_replicas(trace, capacity, settings))
    oracle = policies.Oracle(trace, capacity, settings, headroom=1.0, name=FULL_ORACLE)
    return simulate(trace, oracle, capacity, start)


def dominates(ours: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """SLO attainment at least as high with GPU-hours no higher, strictly better in one."""
    slo, gpu = ours["slo_attainment"], ours["gpu_hours"]
    no_worse = slo >= theirs["slo_attainment"] and gpu <= theirs["gpu_hours"]
    return no_worse and (slo > theirs["slo_attainment"] or gpu < theirs["gpu_hours"])


def target_rows(summary: Summary) -> list[list[object]]:
    rows: list[list[object]] = []
    for trace, by_policy in summary.items():
        ours, oracle = by_policy["kvpilot"], by_policy["oracle"]
        ratio = ours["gpu_hours"] / oracle["gpu_hours"]
        checks: list[tuple[str, str, bool]] = [
            (
                "SLO attainment >= 99%",
                f"{100 * ours['slo_attainment']:.2f}%",
                ours["slo_attainment"] >= 0.99,
            ),
            ("GPU-hours <= 1.2x oracle", f"{ratio:.2f}x", ratio <= 1.2),
        ]
        if trace == "steady":
            changes = ours["direction_changes_per_hour"]
            checks.append(
                ("<= 2 direction changes/h (steady load)", f"{changes:.2f}", changes <= 2)
            )
        for baseline in BASELINES:
            theirs = by_policy[baseline]
            value = (
                f"{100 * ours['slo_attainment']:.2f}% / {ours['gpu_hours']:.1f} GPU-h vs "
                f"{100 * theirs['slo_attainment']:.2f}% / {theirs['gpu_hours']:.1f}"
            )
            checks.append((f"dominates {baseline}", value, dominates(ours, theirs)))
        rows += [[trace, name, value, "yes" if met else "**no**"] for name, value, met in checks]
    return rows


def seed_rows(by_seed: dict[int, Summary]) -> list[list[object]]:
    """Per trace, seed and kvpilot variant: attainment, GPU-hours vs the oracle, and whether it
    dominates each baseline, against issue 33's goals (>= 99%, <= 1.10x the oracle)."""
    rows: list[list[object]] = []
    traces_seen = next(iter(by_seed.values())).keys()
    for trace in traces_seen:
        for seed, summary in by_seed.items():
            by_policy = summary[trace]
            oracle = by_policy["oracle"]
            for name in OURS:
                ours = by_policy[name]
                ratio = ours["gpu_hours"] / oracle["gpu_hours"]
                slo = ours["slo_attainment"]
                rows.append(
                    [
                        trace,
                        seed,
                        name,
                        f"{100 * slo:.2f}%" + ("" if slo >= 0.99 else " (<99)"),
                        f"{ratio:.2f}x" + ("" if ratio <= 1.10 else " (>1.10)"),
                        f"{100 * oracle['slo_attainment']:.2f}%",
                        *("yes" if dominates(ours, by_policy[b]) else "**no**" for b in BASELINES),
                    ]
                )
    return rows


SEED_HEADER = [
    "trace",
    "seed",
    "policy",
    "SLO attainment",
    "GPU-h vs oracle",
    "oracle's attainment",
    *(f"dominates {b}" for b in BASELINES),
]


GOALS_HEADER = ["trace", ">= 99%", "<= 1.10x oracle", *(f"dominates {b}" for b in BASELINES)]


def goals_met(by_seed: dict[int, Summary]) -> list[list[object]]:
    """Issue 33's goals for kvpilot_slo, counted over the seeds."""
    rows: list[list[object]] = []
    seeds = len(by_seed)
    for trace in next(iter(by_seed.values())):
        runs = [summary[trace] for summary in by_seed.values()]
        slo = sum(r["kvpilot_slo"]["slo_attainment"] >= 0.99 for r in runs)
        cost = sum(r["kvpilot_slo"]["gpu_hours"] <= 1.10 * r["oracle"]["gpu_hours"] for r in runs)
        dom = [sum(dominates(r["kvpilot_slo"], r[b]) for r in runs) for b in BASELINES]
        rows.append([trace, f"{slo}/{seeds}", f"{cost}/{seeds}", *(f"{d}/{seeds}" for d in dom)])
    return rows


def body(
    by_seed: dict[int, Summary], capacity: CapacityModel, settings: Settings, seeds: list[int]
) -> str:
    summary = by_seed[seeds[0]]
    seed = seeds[0]
    caps = ", ".join(f"{k}={v}" for k, v in capacity.to_dict().items())
    bounds = policies.user_bounds(settings.min_replicas, settings.max_replicas)
    images = "\n".join(f"![{trace}](img/autoscaler_{trace}.png)" for trace in summary)
    return f"""
Simulated fleets (discrete-event, `kvpilot simulate`), seeds \
{", ".join(str(s) for s in seeds)} (the full table and the plots: seed {seed}), replicas \
{settings.min_replicas}..{settings.max_replicas}, TTFT SLO {TTFT_SLO_S} s. Capacity model per \
replica, assumed for an 8B-class model on one 48 GB GPU (the runtime benchmarks run tiny-llama \
on CPU and publish no per-replica GPU figures yet): {caps}. kvpilot runs with the defaults a \
ModelDeployment gets from the CRD (the same numbers as `policy.Bounds`): target KV-cache usage \
{bounds.target_kv_cache_utilization} (1-minute mean, waiting requests counted as demand), target \
queue {bounds.target_queue_length:g} per replica, tolerance {bounds.tolerance}, scale-up window \
{bounds.scale_up_stabilization_seconds:.0f} s, scale-down window \
{bounds.scale_down_stabilization_seconds:.0f} s (scale-down aims at the band's lower edge and \
waits {bounds.scale_down_settle_s:.0f} s after any change), at most \
x{bounds.max_scale_up_factor:g} or \
+{bounds.max_scale_up_step} per 10 s step. The baselines are described in \
`operator/kvpilot/operator/autoscaling/simulator/policies.py` (their targets: 80% of a \
replica's batch; KEDA 5 waiting per replica); fixed_max is the cost reference, the oracle \
(clairvoyant, 90% of each replica's capacity, one cold start ahead) the floor. kvpilot_slo is \
the same `policy.decide` with a TTFT SLO of {TTFT_SLO_S:g} s at p{SLO_PERCENTILE:g} and the \
planner's seed (batch limit and KV cache, requests assumed \
{replica_capacity.ASSUMED_REQUEST_TOKENS:.0f} tokens): it sees only what the operator reads \
(running, waiting, KV usage, completions, output tokens, TTFT p95, arrivals over 30 s and 120 s, \
the cold starts measured so far, {policy.COLD_START_PRIOR_S:.0f} s assumed before the first).

{markdown_table(TABLE_HEADER, table_rows(summary))}

Targets from issue 6 for kvpilot's policy (seed {seed}):

{markdown_table(["trace", "target", "measured", "met"], target_rows(summary))}

Per seed, both kvpilot variants (issue 33's goals: >= 99% attainment, <= 1.10x the oracle's \
GPU-hours, dominating hpa, kubeai and keda; a failed goal is marked):

{markdown_table(SEED_HEADER, seed_rows(by_seed))}

Issue 33's goals for kvpilot_slo, seeds meeting each:

{markdown_table(GOALS_HEADER, goals_met(by_seed))}

The flash crowd goes from 1.4 to 14 requests/s in 30 s and holds for 10 minutes. A request that a \
replica has queued stays on that replica (as with vLLM's own queue): replicas that become ready \
take new arrivals only, so a backlog built during a cold start drains at the old fleet's rate \
whatever is added. The step burst goes from 4 to 14 requests/s at once: every reactive policy \
serves what arrives during the {capacity.cold_start_s:.0f} s cold start of its new replicas with \
the old fleet, so its SLO attainment there is bounded by the share of the trace in that minute; \
only the clairvoyant oracle starts replicas before the step. `oracle_at_100pct` is the same \
clairvoyant plan with no headroom: where hpa or kubeai use fewer GPU-hours than it, they do so by \
serving late, and no policy that meets the SLO can dominate them. The spikes (1-4 minutes, 2-3x \
the base load) are mostly over before a new replica is ready. Under steady load the right fleet \
lies between 4 replicas (just over 99% SLO attainment) and 5 (100%); kubeai goes from the \
starting 5 to 4 at its first decision, after 60 s, which is the fewest GPU-hours any policy \
starting from that fleet can spend there, so on that trace another policy can at best tie it.

{images}
"""


def run_seed(
    seed: int, capacity: CapacityModel, settings: Settings, jobs: int
) -> tuple[list[Trace], dict[str, dict[str, RunResult]]]:
    bounds = policies.user_bounds(
        settings.min_replicas, settings.max_replicas, TTFT_SLO_S, SLO_PERCENTILE
    )
    built = [traces.build(name, seed) for name in TRACES]
    results = run_matrix(built, policies.NAMES, capacity, settings, bounds, jobs=jobs)
    for trace in built:  # the clairvoyant plan with no headroom at all, for reference
        results[trace.name][FULL_ORACLE] = full_oracle(trace, capacity, settings)
    return built, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    capacity, settings = CapacityModel(), Settings(min_replicas=1, max_replicas=16)
    by_seed: dict[int, Summary] = {}
    for seed in seeds:
        built, results = run_seed(seed, capacity, settings, args.jobs)
        by_seed[seed] = summarise_all(results, TTFT_SLO_S)
        if seed == seeds[0]:
            for trace in built:
                plot(trace, results[trace.name], IMG / f"autoscaler_{trace.name}.png")
    command = "python -m bench.autoscaler_sim"
    if args.seeds != "0,1,2,3,4":
        command += f" --seeds {args.seeds}"
    write_section(
        "autoscaler_sim",
        "Autoscaling policies in simulation",
        command,
        body(by_seed, capacity, settings, seeds),
    )
    print(markdown_table(SEED_HEADER, seed_rows(by_seed)))
    if args.json:
        print(json.dumps(by_seed, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
