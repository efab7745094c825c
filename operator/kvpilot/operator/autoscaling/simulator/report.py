"""Running policies over traces and summarising the runs: figures, tables, plots."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kvpilot.operator.autoscaling.policy import Bounds
from kvpilot.operator.autoscaling.simulator import policies
from kvpilot.operator.autoscaling.simulator.capacity import CapacityModel
from kvpilot.operator.autoscaling.simulator.cluster import RunResult, Settings, simulate
from kvpilot.operator.autoscaling.simulator.traces import Trace


def initial_replicas(trace: Trace, capacity: CapacityModel, settings: Settings) -> int:
    """The fleet every policy starts with: what the first minute needs at the 80% target."""
    need = policies.needed_replicas(trace, capacity, policies.TARGET_FRACTION)[:60]
    wanted = int(need.max()) if len(need) else settings.min_replicas
    return max(settings.min_replicas, min(settings.max_replicas, max(wanted, 1)))


def run_one(
    trace: Trace, name: str, capacity: CapacityModel, settings: Settings, bounds: Bounds
) -> RunResult:
    start = (
        settings.max_replicas
        if name == "fixed_max"
        else initial_replicas(trace, capacity, settings)
    )
    settings = replace(settings, initial_replicas=start)
    policy = policies.build(name, trace, capacity, settings, bounds)
    return simulate(trace, policy, capacity, settings)


def run_matrix(
    traces: Sequence[Trace],
    names: Sequence[str],
    capacity: CapacityModel,
    settings: Settings,
    bounds: Bounds,
    jobs: int = 1,
) -> dict[str, dict[str, RunResult]]:
    """Every policy on every trace; with jobs > 1 the runs go to that many processes."""
    work = [(trace, name) for trace in traces for name in names]
    if jobs > 1 and len(work) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(run_one, t, n, capacity, settings, bounds) for t, n in work]
            runs = [future.result() for future in futures]
    else:
        runs = [run_one(t, n, capacity, settings, bounds) for t, n in work]
    results: dict[str, dict[str, RunResult]] = {}
    for (trace, name), result in zip(work, runs, strict=True):
        results.setdefault(trace.name, {})[name] = result
    return results


def direction_changes(events: Sequence[tuple[float, int, int]]) -> int:
    signs = [1 if new > old else -1 for _, old, new in events if new != old]
    return sum(1 for a, b in itertools.pairwise(signs) if a != b)


def summarise(result: RunResult, ttft_slo_s: float) -> dict[str, float | int]:
    ttft = result.ttft_s
    hours = result.duration_s / 3600.0
    return {
        "slo_attainment": float(np.mean(ttft <= ttft_slo_s)) if len(ttft) else 1.0,
        "gpu_hours": round(result.gpu_hours, 3),
        "scale_events": len(result.scale_events),
        "direction_changes_per_hour": round(direction_changes(result.scale_events) / hours, 3),
        "ttft_p95_s": round(float(np.percentile(ttft, 95)), 3) if len(ttft) else 0.0,
    }


def summarise_all(
    results: dict[str, dict[str, RunResult]], ttft_slo_s: float
) -> dict[str, dict[str, dict[str, float | int]]]:
    return {
        trace: {name: summarise(run, ttft_slo_s) for name, run in runs.items()}
        for trace, runs in results.items()
    }


def table_rows(summary: dict[str, dict[str, dict[str, Any]]]) -> list[list[object]]:
    rows: list[list[object]] = []
    for trace, by_policy in summary.items():
        oracle = by_policy.get("oracle", {}).get("gpu_hours")
        for name, figures in by_policy.items():
            ratio = figures["gpu_hours"] / oracle if oracle else math.nan
            rows.append(
                [
                    trace,
                    name,
                    f"{100 * figures['slo_attainment']:.2f}%",
                    f"{figures['gpu_hours']:.1f}",
                    f"{ratio:.2f}x",
                    figures["scale_events"],
                    f"{figures['direction_changes_per_hour']:.2f}",
                    f"{figures['ttft_p95_s']:.2f}",
                ]
            )
    return rows


TABLE_HEADER = [
    "trace",
    "policy",
    "SLO attainment",
    "GPU-hours",
    "vs oracle",
    "scale events",
    "direction changes/h",
    "TTFT p95 (s)",
]


def plot(trace: Trace, runs: dict[str, RunResult], path: Path) -> None:
    """Request rate, replicas and queued requests over time, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_ax, replica_ax, queue_ax) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    hours = 3600.0
    starts, rate = trace.rate_per_s(max(trace.duration_s / 300, 10.0))
    rate_ax.plot(starts / hours, rate, color="black")
    rate_ax.set_ylabel("requests/s")
    for name, run in runs.items():
        t = np.asarray(run.timeline["t"]) / hours
        replica_ax.step(t, run.timeline["replicas"], where="post", label=name)
        queue_ax.plot(t, run.timeline["waiting"], label=name)
    replica_ax.set_ylabel("replicas")
    queue_ax.set_ylabel("queued requests")
    queue_ax.set_xlabel("hours")
    replica_ax.legend(loc="upper left", fontsize="small", ncol=3)
    rate_ax.set_title(f"trace {trace.name}: {trace.num_requests} requests")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
