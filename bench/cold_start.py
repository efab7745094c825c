"""Cold start by phase: a runtime process from its creation to Ready, and with --cluster a
replacement pod's Ready and the first token from zero through the gateway, in one run.

    python -m bench.cold_start [--runs 3] [--cluster]

The runtime part starts `kvpilot-runtime serve` on tiny-llama `--runs` times per variant and
reads each start's phases from /version (runtime/server/startup.py), beside the start the client
observed (process spawned -> first /ready 200, polled every 0.1 s) and the first and second
one-token requests after Ready (what a warm-up would save), and the CPU seconds the process had
used when it was Ready (its threads' user + system time from /proc: on this shared machine the
wall clock depends on the load, the CPU time much less). Variants: `as installed` (the venv's
bytecode as it is; a venv installed without it, with PYTHONDONTWRITEBYTECODE set, compiles
every module, torch's 2,400 among them, from source at each start) and `bytecode cache`
(PYTHONPYCACHEPREFIX, filled by one start that is not counted: what a venv or an image with
compiled bytecode gives).

The cluster part (the dev cluster's `local` pool: pods are real processes on this machine) runs
bench.model_cache_startup (a replica's pod deleted, its replacement timed to Ready, then a
scale-up onto a free GPU timed from the write of the replicas to the new pod's Ready; model from
the cache and fetched per pod) and bench.gateway_scale_from_zero (requests held by the gateway while
the model wakes from zero pods, to the first streamed token).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.report import markdown_table, write_section
from bench.server_common import runtime_server
from kvpilot.contract.metric_names import STARTUP_PHASES

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "tiny-llama"


# What the figures above do not show on their own (the cuts whose old path no longer exists).
NOTES = (
    "The `kernel` phase loads the cached paged-attention library as it is; before, torch's "
    "cpp_extension checked it with ninja at every start (0.2 s when nothing changed) and "
    "rebuilt it whenever another checkout of the source had used the cache last: 70-95 s at a "
    "load of 5-7 on this machine, where several checkouts share ~/.cache/kvpilot/kernels "
    "(measured on the commit before, timing `paged_kernel.unavailable_reason()` in a fresh "
    "process). The `warmup` phase runs no dummy batch: the first request after Ready is a few "
    "tenths of a second slower than the second at most, and a warm-up step would move that into "
    "the start, not remove it. The operator's pods now probe /ready every second from the start "
    "(startupProbe) where the startup probe was /health every 10 s, then readiness every 5 s: on "
    "a kubelet that put up to 15 s between the engine's Ready and the pod's; the dev cluster's "
    "pod runner probed every second while not ready already, so the cluster figures here do not "
    "show it. The pod runner ticked every 0.5 s only: a pod bound to its node waited up to 0.5 s "
    "to start, an init container's successor up to 1 s, a deleted pod's object (and so the GPU "
    "its replacement waits for) up to 0.5 s after its process had exited; it now ticks on a pod "
    "watch per node and on each container process's exit (the replacement's `scheduled -> "
    "process created` was 0.22-0.55 s with the model cached, at loads of 12-16, on the commit "
    "before). The imports run with the garbage collector paused, and what they made is frozen "
    "after (server/startup.py, collector_paused): on the commit before, ~530 collections "
    "traversed torch's growing heap during the imports; interleaved against it, the import's "
    "CPU went from 2.23 to 1.85 s (medians of 5, load 9-11) and an idle server's SIGTERM -> "
    "exit, which a replacement waiting for the old pod's GPU waits for, from 1.6-1.9 to "
    "0.8-0.9 s (load 7-11). jinja2 is imported at the first chat request. The pod runner runs "
    "probes that fall due before its tick's API lists, on their period's ticks, as a kubelet's "
    "probe worker does (before, each probe waited for the lists and each late one pushed the "
    "later ones back)."
)


@dataclass(frozen=True)
class Start:
    """One runtime start: its phases (seconds each added), what the client saw, first requests."""

    phases: dict[str, float]
    observed_s: float  # process spawned -> first /ready 200 seen
    cpu_at_ready_s: float  # the process's user + system seconds (all threads) at that moment
    first_request_s: float  # the first one-token completion after Ready
    second_request_s: float


def one_token(url: str) -> float:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
    return time.perf_counter() - started


def cpu_seconds(proc_stat: str, ticks_per_s: int) -> float:
    """User + system seconds of a process (all its threads) from /proc/<pid>/stat: fields 14
    and 15, counted from the command name's closing parenthesis (the name may hold spaces)."""
    after_name = proc_stat[proc_stat.rindex(")") + 2 :].split()
    return (int(after_name[14 - 3]) + int(after_name[15 - 3])) / ticks_per_s


def process_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        return cpu_seconds(stat.read(), os.sysconf("SC_CLK_TCK"))


def one_start(env: dict[str, str]) -> Start:
    spawned = time.perf_counter()
    with runtime_server(TINY, "--max-model-len", "256", env=env) as (url, pid):
        observed = time.perf_counter() - spawned
        cpu_at_ready = process_cpu_seconds(pid)
        phases = httpx.get(f"{url}/version", timeout=10).json()["startup"]["phases"]
        first, second = one_token(url), one_token(url)
    return Start(phases, observed, cpu_at_ready, first, second)


def variants(work: Path) -> dict[str, dict[str, str]]:
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    cached = {k: v for k, v in base.items() if k != "PYTHONDONTWRITEBYTECODE"}
    cached["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    return {"as installed": base, "bytecode cache": cached}


def runtime_starts(runs: int) -> dict[str, list[Start]]:
    with tempfile.TemporaryDirectory(prefix="kvpilot-cold-") as work:
        envs = variants(Path(work))
        one_start(envs["bytecode cache"])  # fills the cache; the kernel is built if it is not
        starts: dict[str, list[Start]] = {name: [] for name in envs}
        for _ in range(runs):  # interleaved, so a change in the machine's load hits both
            for name, env in envs.items():
                starts[name].append(one_start(env))
        return starts


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}"


def runtime_table(starts: dict[str, list[Start]]) -> str:
    rows = [
        [f"phase: {phase}", *(median([s.phases[phase] for s in runs]) for runs in starts.values())]
        for phase in STARTUP_PHASES
    ]
    rows += [
        ["sum of the phases (creation -> Ready)",
         *(median([sum(s.phases.values()) for s in runs]) for runs in starts.values())],
        ["observed: spawned -> first /ready 200",
         *(median([s.observed_s for s in runs]) for runs in starts.values())],
        ["CPU used by then (user + system, all threads)",
         *(median([s.cpu_at_ready_s for s in runs]) for runs in starts.values())],
        ["first 1-token request after Ready",
         *(median([s.first_request_s for s in runs]) for runs in starts.values())],
        ["second 1-token request",
         *(median([s.second_request_s for s in runs]) for runs in starts.values())],
    ]  # fmt: skip
    return markdown_table(["seconds (median)", *starts], rows)


def cluster_sections(repeats: int, requests: int) -> str:
    """A replacement pod's Ready (from the cache, fetched per pod) and the first token from
    zero, each on a dev cluster of its own (the two benchmarks' own set-ups)."""
    from bench import gateway_scale_from_zero, model_cache_startup
    from hack import closedloop
    from hack.devcluster import DevCluster

    load = os.getloadavg()[0]
    results = model_cache_startup.run(repeats)
    runs = results.replacements
    rows = [[name, median([r.seconds for r in reps]), " ".join(f"{r.seconds:.2f}" for r in reps)]
            for name, reps in runs.items()]  # fmt: skip
    replacement = markdown_table(["model reaches the pod", "replacement Ready s", "runs"], rows)
    replacement += (
        f"\n\nBy phase (bench/pod_phases.py: a watch on the pods, the runtime's /version):\n\n"
        f"{model_cache_startup.phases_table(runs)}\n\n{model_cache_startup.WAITS_FOR_THE_GPU}"
    )
    cluster = DevCluster(Path(tempfile.mkdtemp(prefix="kvpilot-cold-zero-")) / "cluster")
    try:
        cluster.up()
        url = closedloop.start_zero_gateway(
            cluster, gateway_scale_from_zero.NAME, gateway_scale_from_zero.IDLE_S,
            gateway_scale_from_zero.FALLBACK_AFTER_S,
        )  # fmt: skip
        held, marks = gateway_scale_from_zero.measure(cluster, url, requests)
    finally:
        cluster.down()
    return (
        f"The dev cluster's part began at a load average of {load:.1f}.\n\n"
        f"Replacement pod on the `local` pool ({repeats} runs, interleaved):\n\n{replacement}\n\n"
        f"Scale-up onto a free GPU on the `local` pool ({repeats} runs per variant, interleaved, "
        f"after the replacements):\n\n"
        f"{model_cache_startup.scale_up_report(results.scale_ups)}\n\n"
        f"First token from zero through the gateway:\n\n"
        f"{gateway_scale_from_zero.report(held, marks)}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="starts per variant")
    parser.add_argument("--cluster", action="store_true", help="the dev cluster's figures too")
    parser.add_argument("--repeats", type=int, default=3, help="replacement pods (--cluster)")
    parser.add_argument("--requests", type=int, default=4, help="held from zero (--cluster)")
    args = parser.parse_args(argv)
    starts = runtime_starts(args.runs)
    body = (
        f"`kvpilot-runtime serve` on tiny-llama (7.6 MiB), {args.runs} starts per variant, "
        "interleaved; the load average when it began: "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores. Phases from each start's "
        "/version (the seconds each added, from the process's creation to /ready 200).\n\n"
        f"{runtime_table(starts)}\n\n{NOTES}\n"
    )
    command = f"python -m bench.cold_start --runs {args.runs}"
    if args.cluster:
        body += "\n" + cluster_sections(args.repeats, args.requests)
        command += f" --cluster --repeats {args.repeats} --requests {args.requests}"
    print(body)
    write_section("cold_start", "Cold start by phase (issue 33 item 4)", command, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
