"""`make demo`: the whole kvpilot story on one machine, printed as it happens.

1. the dev cluster with fake GPU node pools (or the cluster KUBECONFIG points at);
2. the CRD and the operator;
3. a 7B ModelDeployment: the plan per GPU node type — which quantisation fits where, and why;
4. tiny-llama on the `local` pool, where pods are real runtime processes;
5. a load burst with `kvpilot bench`, while the queue, KV usage, replicas and the autoscaler's
   decisions are printed; then the load stops and the scale-down shows;
6. a summary: TTFT p95, tokens/s, cost per 1,000 requests, scale events.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from hack import closedloop
from hack.devcluster import DevCluster, DevClusterError, procs
from hack.devcluster.versions import REPO_ROOT

EXAMPLES = REPO_ROOT / "examples"
TINY = "tiny-llama"
SEVEN_B = "qwen2-5-7b-instruct"
SEVENTY_B = "llama-3-1-70b-instruct"
BIN = Path(sys.executable).parent
PROXY_PORT_NAME = "demo-proxy"
WATCH_EVERY_S = 2.0
AUTOSCALER_INTERVAL_S = 5
SCALE_DOWN_WINDOW_S = 30


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def tiny_llama_manifest() -> dict[str, Any]:
    # The local pool has two 1-GPU nodes; a batch of 4 makes a 32-stream burst queue.
    return closedloop.tiny_llama(TINY, 4, closedloop.builtin_autoscaling(2, SCALE_DOWN_WINDOW_S))


class Demo:
    def __init__(self, cluster: DevCluster, own_cluster: bool) -> None:
        self.cluster = cluster
        self.own_cluster = own_cluster
        self.workdir = Path(tempfile.mkdtemp(prefix="kvpilot-demo-"))

    def kubectl(self, *args: str, input: str | None = None) -> str:
        return self.cluster.kubectl(*args, input=input).stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    # -- steps -----------------------------------------------------------------------------

    def install(self) -> None:
        say("installing the ModelDeployment CRD (kubectl apply --server-side -f crds/)")
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO_ROOT / "crds"))
        self.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/modeldeployments.kvpilot.dev",
        )
        if not self.own_cluster:
            return  # an existing cluster runs the operator it was installed with (Helm)
        say("starting the operator (kvpilot-operator run; log: .devcluster/logs/operator.log)")
        env = {
            **self.cluster.env,
            "KVPILOT_PROMETHEUS_URL": self.cluster.prometheus_url,
            "KVPILOT_AUTOSCALER_INTERVAL": str(AUTOSCALER_INTERVAL_S),
        }
        self.cluster.start_process(
            "operator", [str(BIN / "kvpilot-operator"), "run", "--standalone"], env=env
        )

    def show_plan(self, name: str, example: str, question: str) -> None:
        say(f"applying {name}: {question}")
        self.kubectl("apply", "-f", str(EXAMPLES / example))
        status = self.wait_for(lambda: self.status(name).get("plan"), 90, "a plan")
        rows = [["NODE TYPE", "FITS", "QUANT", "TP", "WEIGHTS", "KV", "MAX SEQS", "$/H", "WHY"]]
        for entry in status:
            rows.append(
                [
                    entry["nodeType"],
                    "yes" if entry["fits"] else "no",
                    entry.get("quantization") or "-",
                    str(entry.get("tensorParallel") or "-"),
                    f"{entry.get('weightsGiB', 0):.1f}Gi",
                    f"{entry.get('kvCacheGiB', 0):.1f}Gi",
                    str(entry.get("maxConcurrency") or "-"),
                    f"{entry.get('pricePerHour', 0):.2f}",
                    entry.get("reason", ""),
                ]
            )
        print(table(rows))

    def serve_tiny_llama(self) -> None:
        say("applying tiny-llama on the local pool: its pods are real kvpilot-runtime processes")
        self.kubectl("apply", "-f", "-", input=json.dumps(tiny_llama_manifest()))
        self.wait_for(
            lambda: self.status(TINY).get("readyReplicas", 0) >= 1, 300, "tiny-llama to be Ready"
        )
        print(self.kubectl("get", "modeldeployments"))

    def load_burst(self) -> dict[str, Any]:
        url = self.endpoint()
        result = self.workdir / "bench.json"
        say(f"load burst: kvpilot bench, 32 concurrent streams against {url}")
        bench = subprocess.Popen(
            [
                str(BIN / "kvpilot"),
                "bench",
                "--base-url",
                url,
                "--model",
                TINY,
                "--concurrency",
                "32",
                "--num-prompts",
                "400",
                "--input-len",
                "48",
                "--output-len",
                "48",
                "--ignore-eos",
                "--price-per-gpu-hour",
                "0.98",
                "--result-json",
                str(result),
                "--no-progress",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        self.watch(lambda: bench.poll() is not None, 900)
        if bench.returncode != 0:
            raise DevClusterError(f"kvpilot bench failed with exit code {bench.returncode}")
        return dict(json.loads(result.read_text()))

    def scale_down(self) -> None:
        say(f"load stopped: replicas fall after the {SCALE_DOWN_WINDOW_S}s stabilisation window")
        window = SCALE_DOWN_WINDOW_S + 120
        self.watch(lambda: self.status(TINY).get("replicas", 0) <= 1, window)

    def summary(self, report: dict[str, Any]) -> None:
        events = self.get("events", "--field-selector", f"involvedObject.name={TINY}")["items"]
        scales = [e["message"] for e in events if e.get("reason", "").startswith("Scal")]
        say("summary")
        summary = report.get("summary", {})
        ttft_p95 = summary.get("ttft_ms", {}).get("percentiles", {}).get("p95", 0.0)
        figures = {
            "requests completed / failed": f"{summary.get('completed')} / {summary.get('failed')}",
            "TTFT p95": f"{ttft_p95:.0f} ms",
            "output tokens/s": f"{summary.get('output_throughput', 0.0):.0f}",
            "cost per 1,000 requests": f"${summary.get('cost_per_1k_requests') or 0.0:.4f}"
            " at $0.98 per GPU-hour",
        }
        for label, value in figures.items():
            print(f"  {label:<28} {value}")
        print(f"  scale events                 {len(scales)}")
        for message in scales:
            print(f"    - {message}")

    # -- helpers -----------------------------------------------------------------------------

    def status(self, name: str) -> dict[str, Any]:
        found = self.cluster.kubectl("get", "modeldeployment", name, "-o", "json", check=False)
        return dict(json.loads(found.stdout).get("status", {})) if found.returncode == 0 else {}

    def endpoint(self) -> str:
        if self.own_cluster:
            url = closedloop.start_proxy(self.cluster, PROXY_PORT_NAME, TINY)
        else:
            port = procs.free_port()
            subprocess.Popen(
                ["kubectl", "port-forward", f"svc/{TINY}", f"{port}:8000"],
                env=self.cluster.env,
                stdout=subprocess.DEVNULL,
            )
            url = f"http://127.0.0.1:{port}"
        self.wait_for(lambda: procs.http_ok(f"{url}/v1/models"), 60, "the service endpoint")
        return url

    def watch(self, done: Any, timeout_s: float) -> None:
        print(f"  {'time':>5}  {'waiting':>7}  {'KV use':>6}  {'replicas':>8}  decision")
        started, last = time.monotonic(), ""
        while not done() and time.monotonic() - started < timeout_s:
            status = self.status(TINY)
            auto = status.get("autoscaling", {})
            line = (
                f"{self.metric('sum(kvpilot_requests_waiting{kvpilot_model=%r})'):>7.0f}  "
                f"{self.metric('avg(kvpilot_kv_cache_usage_ratio{kvpilot_model=%r})'):>6.0%}  "
                f"{status.get('readyReplicas', 0)}/{status.get('replicas', 0):<6}  "
                f"{auto.get('lastDecision', '')}"
            )
            if line != last:
                print(f"  {time.monotonic() - started:>4.0f}s  {line}", flush=True)
                last = line
            time.sleep(WATCH_EVERY_S)

    def metric(self, template: str) -> float:
        if not self.own_cluster:
            return float("nan")
        query = urllib.parse.quote(template % TINY)
        try:
            with urllib.request.urlopen(
                f"{self.cluster.prometheus_url}/api/v1/query?query={query}", timeout=3
            ) as resp:
                result = json.load(resp)["data"]["result"]
            return float(result[0]["value"][1]) if result else 0.0
        except (OSError, ValueError, KeyError):
            return float("nan")

    def wait_for(self, predicate: Any, timeout_s: float, what: str) -> Any:
        if not procs.wait_for(predicate, timeout_s, 1.0):
            raise DevClusterError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        return predicate()


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    )


def main() -> int:
    own_cluster = not os.environ.get("KUBECONFIG")
    cluster = DevCluster()
    if not own_cluster:  # apply and watch only, with the user's kubeconfig
        cluster.kubeconfig = Path(os.environ["KUBECONFIG"])
    try:
        if own_cluster and not cluster.is_up():
            cluster.up()
        demo = Demo(cluster, own_cluster)
        say(
            "GPU node pools\n"
            + cluster.kubectl(
                "get",
                "nodes",
                "-L",
                "kvpilot.dev/node-type,nvidia.com/gpu.product,nvidia.com/gpu.count",
            ).stdout
        )
        demo.install()
        demo.show_plan(
            SEVEN_B,
            "qwen2.5-7b-instruct.yaml",
            "where does a 7B model fit, and at which quantisation?",
        )
        demo.show_plan(
            SEVENTY_B,
            "llama-3.1-70b-instruct.yaml",
            "and a 70B model: tensor parallelism, and where it cannot fit",
        )
        demo.serve_tiny_llama()
        report = demo.load_burst()
        demo.scale_down()
        demo.summary(report)
    except DevClusterError as err:
        print(f"demo: {err}", file=sys.stderr)
        return 1
    print(
        '\nExplore: eval "$(make -s cluster-env)" && kubectl get modeldeployments\n'
        "Clean up: make demo-down"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
