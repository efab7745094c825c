"""kvpilot-gateway's load factor: how often a bound spills requests off their prefix's replica.

    .venv/bin/python -m bench.gateway_load_factor [--factors 1.25,1.5,1.75,2] [--repeats 2]

bench.gateway_routing's shared-prefix workload (16 tenants with ~1000-token system prompts, 8
questions each, 16 clients in a closed loop, two tiny-llama replicas with a 24 MiB KV pool each)
through a prefix-affinity gateway at each `--load-factor`, fresh tenants for every run. A request
the bound sends off its prefix's replica pays a full prefill there and brings its prefix into the
other replica's cache; too low a factor spills so often that both caches thrash. With two
replicas, a factor of 2 puts no bound at all (a replica's load + 1 never exceeds twice the mean).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from bench.gateway_routing import (
    Phase,
    gateway,
    p50,
    p95,
    parse_cli,
    replica_limits,
    run_phase,
    runtime_replicas,
    tenant_workload,
)
from bench.report import markdown_table, write_section

TENANTS, QUESTIONS = 16, 8
COLUMNS = ["load factor", "run", "prefix-cache hit rate", "TTFT p95 (ms)", "TTFT p50 (ms)",
           "requests per replica"]  # fmt: skip
FIRST_PHASE = 100  # tenant texts of their own: gateway_routing's phases use 0 to ~40


def parse_factors(text: str) -> list[float]:
    factors = [float(f) for f in text.split(",")]
    if not factors or min(factors) < 1:
        raise argparse.ArgumentTypeError(f"load factors must be >= 1, got {text!r}")
    return factors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--factors", type=parse_factors, default=[1.25, 1.5, 1.75, 2.0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    limits = replica_limits(parse_cli([]), 24)
    runs: list[tuple[float, int, Phase]] = []
    with tempfile.TemporaryDirectory() as tmp, runtime_replicas(2, limits) as replicas:
        workdir, phase = Path(tmp), FIRST_PHASE
        for repeat in range(1, args.repeats + 1):
            for factor in args.factors:
                phase += 1
                workload = tenant_workload(phase, TENANTS, QUESTIONS, workdir)
                flags = ("--load-factor", str(factor))
                with gateway(replicas, "prefix", workdir, *flags) as url:
                    runs.append((factor, repeat, run_phase("prefix", url, replicas, workload,
                                                           TENANTS)))  # fmt: skip
    rows = [[f"{factor:g}", repeat, f"{100 * run.hit_rate:.1f}%", f"{p95(run.summary):.1f}",
             f"{p50(run.summary):.1f}", " / ".join(map(str, run.served))]
            for factor, repeat, run in sorted(runs, key=lambda r: (r[0], r[1]))]  # fmt: skip
    body = (
        f"{TENANTS} tenants x {QUESTIONS} questions, {TENANTS} clients in a closed loop, two "
        "replicas with a 24 MiB KV pool each (the workload of gateway_routing's part (a), whose "
        "last row is the one-replica reference); one prefix-affinity gateway per run at the "
        "load factor shown, fresh tenants every run, runs interleaved by repeat.\n\n"
        + markdown_table(COLUMNS, rows)
        + "\n"
    )
    print(body)
    factors = ",".join(f"{f:g}" for f in args.factors)
    command = f"python -m bench.gateway_load_factor --factors {factors} --repeats {args.repeats}"
    write_section("gateway_load_factor", "Gateway: the load factor", command, body)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
