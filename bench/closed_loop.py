"""Closed-loop figures on the dev cluster (issue 7): how fast the loop reacts, what it buys.

One run, two configurations of the same tiny-llama ModelDeployment on the `local` pool (real
runtime pods) and the same `kvpilot bench` burst: builtin autoscaling 1..2 replicas vs replicas
fixed at the minimum (1). Reported: time from load start to the first scale-up decision and to
the new pod Ready; TTFT p95 during the burst for both; requests lost during the scale-down.

    python -m bench.closed_loop
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import markdown_table, write_section
from hack import closedloop
from hack.devcluster import DevCluster, procs
from hack.devcluster.versions import REPO_ROOT

BIN = Path(sys.executable).parent
NAME = "tiny-bench"
PROMPTS, CONCURRENCY = 300, 16
DOWN_WINDOW_S = 10


def status(cluster: DevCluster) -> dict[str, Any]:
    out = cluster.kubectl("get", "modeldeployment", NAME, "-o", "json", check=False)
    return dict(json.loads(out.stdout).get("status", {})) if out.returncode == 0 else {}


def deploy(cluster: DevCluster, autoscaling: dict[str, Any]) -> str:
    cluster.kubectl("delete", "modeldeployment", NAME, "--ignore-not-found", "--wait=true")
    procs.wait_for(lambda: not status(cluster), 120, 1.0)
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps(closedloop.tiny_llama(NAME, 2, autoscaling))
    )
    url = closedloop.start_proxy(cluster, "bench-proxy", NAME)
    if not procs.wait_for(lambda: procs.http_ok(f"{url}/v1/models"), 300, 1.0):
        raise RuntimeError("tiny-llama did not start serving")
    return url


def burst(cluster: DevCluster, url: str, out: Path) -> tuple[dict[str, Any], dict[str, float]]:
    """Run the burst; note when the first scale-up decision and the second Ready pod came."""
    started = time.monotonic()
    marks: dict[str, float] = {}
    bench = subprocess.Popen(
        closedloop.bench_argv(url, NAME, CONCURRENCY, PROMPTS, out),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    while bench.poll() is None:
        now = status(cluster)
        if (now.get("autoscaling") or {}).get("desiredReplicas", 1) >= 2:
            marks.setdefault("decision_s", time.monotonic() - started)
        if now.get("readyReplicas", 0) >= 2:
            marks.setdefault("ready_s", time.monotonic() - started)
        time.sleep(0.25)
    return json.loads(out.read_text())["summary"], marks


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="kvpilot-bench-loop-"))
    cluster = DevCluster(work / "cluster")
    try:
        cluster.up()
        cluster.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", str(REPO_ROOT / "crds")
        )
        env = {
            **cluster.env,
            "KVPILOT_PROMETHEUS_URL": cluster.prometheus_url,
            "KVPILOT_AUTOSCALER_INTERVAL": "2",
        }
        cluster.start_process(
            "bench-operator", [str(BIN / "kvpilot-operator"), "run", "--standalone"], env=env
        )
        auto = closedloop.builtin_autoscaling(2, DOWN_WINDOW_S)
        scaled, marks = burst(cluster, deploy(cluster, auto), work / "auto.json")
        procs.wait_for(lambda: status(cluster).get("replicas") == 1, DOWN_WINDOW_S + 120, 1.0)
        fixed, _ = burst(
            cluster, deploy(cluster, {"mode": "off", "replicas": 1}), work / "fixed.json"
        )
    finally:
        cluster.down()
    report(scaled, fixed, marks)
    return 0


def report(scaled: dict[str, Any], fixed: dict[str, Any], marks: dict[str, float]) -> None:
    def p95(summary: dict[str, Any]) -> float:
        return float(summary["ttft_ms"]["percentiles"]["p95"])

    rows = [
        ["load start -> first scale-up decision", f"{marks.get('decision_s', float('nan')):.1f} s"],
        ["load start -> new pod Ready", f"{marks.get('ready_s', float('nan')):.1f} s"],
        ["TTFT p95, autoscaling 1..2", f"{p95(scaled):.0f} ms"],
        ["TTFT p95, fixed at 1 replica", f"{p95(fixed):.0f} ms"],
        ["TTFT p95 ratio fixed / autoscaled", f"{p95(fixed) / p95(scaled):.2f}x"],
        ["requests failed (burst and scale-down), autoscaled", str(scaled["failed"])],
        ["requests failed, fixed", str(fixed["failed"])],
    ]
    body = (
        f"tiny-llama on the dev cluster's `local` pool (real runtime pods on this machine's CPU),\n"
        f"`serving.maxNumSeqs: 2`, burst of {PROMPTS} requests at concurrency {CONCURRENCY}\n"
        f"(32 prompt / 64 output tokens), autoscaler interval 2 s, Prometheus scrape 2 s,\n"
        f"scale-down window {DOWN_WINDOW_S} s. Both replicas share the same 2 CPU cores, so the\n"
        "second replica adds queue slots, not compute: on a real cluster each has its own GPU.\n\n"
        + markdown_table(["figure", "value"], rows)
    )
    write_section(
        "closed_loop",
        "Closed loop: autoscaling on the dev cluster",
        "python -m bench.closed_loop",
        body,
    )
    print(body)


if __name__ == "__main__":
    sys.exit(main())
