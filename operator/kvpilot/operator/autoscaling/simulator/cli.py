"""`kvpilot simulate`: compare autoscaling policies on request traces, without a cluster."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpilot.operator.autoscaling.simulator import policies, traces
from kvpilot.operator.autoscaling.simulator.capacity import CapacityModel
from kvpilot.operator.autoscaling.simulator.cluster import Settings
from kvpilot.operator.autoscaling.simulator.report import (
    TABLE_HEADER,
    plot,
    run_matrix,
    summarise_all,
    table_rows,
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpilot simulate", description=__doc__)
    parser.add_argument(
        "--trace",
        action="append",
        help=f"{', '.join(traces.BUILTIN)} or a .jsonl file (repeatable; default burst, diurnal)",
    )
    parser.add_argument("--policy", default=",".join(policies.NAMES), help="comma-separated")
    parser.add_argument("--duration-s", type=float, help="override every trace's duration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int, default=16)
    parser.add_argument("--ttft-slo-s", type=float, default=2.0)
    parser.add_argument(
        "--slo-percentile",
        type=float,
        default=99.0,
        help="of requests the TTFT SLO bounds, for kvpilot_slo (default 99)",
    )
    parser.add_argument("--capacity", type=Path, help="JSON file with CapacityModel fields")
    parser.add_argument("--plots", type=Path, help="write one PNG per trace into this folder")
    parser.add_argument("--jobs", type=int, default=1, help="processes to run policies in")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        capacity = CapacityModel.from_json(args.capacity) if args.capacity else CapacityModel()
        settings = Settings(args.min_replicas, args.max_replicas, max(args.min_replicas, 1))
        bounds = policies.user_bounds(
            args.min_replicas, args.max_replicas, args.ttft_slo_s, args.slo_percentile
        )
        names = [n.strip() for n in args.policy.split(",") if n.strip()]
        unknown = sorted(set(names) - set(policies.NAMES))
        if unknown:
            raise ValueError(f"unknown policies {unknown}: use {', '.join(policies.NAMES)}")
        specs = args.trace or ["burst", "diurnal"]
        built = [traces.build(spec, args.seed, args.duration_s) for spec in specs]
    except (ValueError, OSError) as exc:
        print(f"kvpilot simulate: {exc}", file=sys.stderr)
        return 2
    results = run_matrix(built, names, capacity, settings, bounds, jobs=args.jobs)
    summary = summarise_all(results, args.ttft_slo_s)
    if args.plots:
        for trace in built:
            plot(trace, results[trace.name], args.plots / f"{trace.name}.png")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(" | ".join(TABLE_HEADER))
        for row in table_rows(summary):
            print(" | ".join(str(cell) for cell in row))
    return 0
