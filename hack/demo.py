"""`make demo`: the whole kvpilot story on one machine, printed as it happens.

1. the dev cluster with fake GPU node pools (or the cluster KUBECONFIG points at);
2. the CRD and the operator;
3. a 7B ModelDeployment: the plan per GPU node type — which quantisation fits where, and why;
4. tiny-llama on the `local` pool, where pods are real runtime processes, behind the chart's
   kvpilot-gateway (`helm upgrade --install` with hack/devcluster/chart-values.yaml: its pods run
   on the `local` pool too): one OpenAI endpoint for every model;
5. a load burst through the gateway with `kvpilot bench` (tenants whose requests share a long
   preamble), while the queue, KV usage, replicas and the autoscaler's decisions are printed;
   then the load stops and the scale-down shows;
6. a summary: TTFT p95, tokens/s, cost per 1,000 requests, scale events, and the routing figures:
   the replicas the gateway picked, their prefix-cache hit rates, retries and fallbacks.
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

from prometheus_client.parser import text_string_to_metric_families

from hack import closedloop
from hack.devcluster import DevCluster, DevClusterError, chart, procs
from hack.devcluster.versions import REPO_ROOT

EXAMPLES = REPO_ROOT / "examples"
TINY = "tiny-llama"
SEVEN_B = "qwen2-5-7b-instruct"
SEVENTY_B = "llama-3-1-70b-instruct"
BIN = Path(sys.executable).parent
GATEWAY_PROXY = "demo-gateway-proxy"
RELEASE, RELEASE_NAMESPACE = "kvpilot", "kvpilot-system"
TENANTS, REQUESTS_PER_TENANT, OUTPUT_LEN = 8, 50, 48
WATCH_EVERY_S = 2.0
AUTOSCALER_INTERVAL_S = 5
SCALE_DOWN_WINDOW_S = 30


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def tenant_prompts(tenants: int, per_tenant: int, output_len: int) -> list[dict[str, Any]]:
    """`kvpilot bench --dataset` records: each tenant's requests share its preamble (longer than
    the gateway's prefix key, 256 characters) and differ in the question; tenants interleave."""
    records = []
    for question in range(per_tenant):
        for tenant in range(tenants):
            rules = " ".join(f"Rule {r}: answer tenant {tenant} briefly." for r in range(10))
            prompt = f"You are the assistant of tenant {tenant}. {rules}\nQ{question}: why?"
            records.append({"prompt": prompt, "max_tokens": output_len})
    return records


def counter_sums(texts: list[str], family: str, label: str | None) -> dict[str, float]:
    """A counter family's samples summed over every /metrics text, by one label's value ('all'
    when `label` is None)."""
    sums: dict[str, float] = {}
    for text in texts:
        for found in text_string_to_metric_families(text):
            if found.name != family:
                continue
            for sample in found.samples:
                if sample.name == f"{family}_total":
                    key = sample.labels.get(label, "") if label else "all"
                    sums[key] = sums.get(key, 0.0) + sample.value
    return sums


def growth(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each counter gained between two readings (a key absent before started at zero)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def routing_rows(
    picks: dict[str, float], hits: dict[str, float], queries: dict[str, float]
) -> list[list[str]]:
    """The routing table: per replica (`namespace/pod`) its picks and prefix-cache hit rate."""
    rows = [["REPLICA", "PICKS", "PREFIX-CACHE HIT RATE"]]
    for replica in sorted(set(picks) | set(queries)):
        if not picks.get(replica) and not queries.get(replica):
            continue  # a replica gone before the burst (its counters did not move)
        rows.append([replica, f"{picks.get(replica, 0):.0f}", rate(hits, queries, replica)])
    total_hits, total_queries = sum(hits.values()), sum(queries.values())
    everyone = {"all": total_hits}, {"all": total_queries}
    rows.append(["all", f"{sum(picks.values()):.0f}", rate(*everyone, "all")])
    return rows


def by_key(counts: dict[str, float]) -> str:
    """`0`, or the total with each key's count: `3 (503: 1, connect: 2)`."""
    total = sum(counts.values())
    if not total:
        return "0"
    shares = ", ".join(f"{key}: {n:.0f}" for key, n in sorted(counts.items()) if n)
    return f"{total:.0f} ({shares})"


def rate(hits: dict[str, float], queries: dict[str, float], key: str) -> str:
    asked = queries.get(key, 0.0)
    return f"{hits.get(key, 0.0) / asked:.0%}" if asked else "-"


def tiny_llama_manifest() -> dict[str, Any]:
    # The local pool has two 1-GPU nodes; a batch of 4 makes a 32-stream burst queue.
    return closedloop.tiny_llama(TINY, 4, closedloop.builtin_autoscaling(2, SCALE_DOWN_WINDOW_S))


class Demo:
    def __init__(self, cluster: DevCluster, own_cluster: bool) -> None:
        self.cluster = cluster
        self.own_cluster = own_cluster
        self.workdir = Path(tempfile.mkdtemp(prefix="kvpilot-demo-"))
        self.routing: dict[str, dict[str, float]] = {}

    def kubectl(self, *args: str, input: str | None = None) -> str:
        return self.cluster.kubectl(*args, input=input).stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    # -- steps -----------------------------------------------------------------------------

    def install(self) -> None:
        say("installing the ModelDeployment CRD (kubectl apply --server-side -f crds/)")
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO_ROOT / "crds"))
        closedloop.wait_established(self.cluster, str(REPO_ROOT / "crds"))
        if not self.own_cluster:
            return  # an existing cluster runs the operator it was installed with (Helm)
        say("starting the operator (kvpilot-operator run; log: .devcluster/logs/operator.log)")
        closedloop.start_operator(self.cluster, "operator", AUTOSCALER_INTERVAL_S)
        say(
            f"helm upgrade --install {RELEASE} charts/kvpilot -n {RELEASE_NAMESPACE}"
            f" --values {chart.VALUES.relative_to(REPO_ROOT)}: kvpilot-gateway's 2 pods on the"
            " local pool (real processes, acting as the gateway's ServiceAccount)"
        )
        chart.helm_install(self.cluster, RELEASE, RELEASE_NAMESPACE)
        print(self.kubectl("get", "pods", "-n", RELEASE_NAMESPACE, "-o", "wide"))

    def show_plan(self, name: str, example: str, question: str) -> None:
        say(f"applying {name}: {question}")
        self.kubectl("apply", "-f", str(EXAMPLES / example))
        status = self.wait_for(lambda: self.status(name).get("plan"), 90, "a plan")
        rows = plan_rows(status)
        print(table(rows))

    def serve_tiny_llama(self, manifest: dict[str, Any]) -> None:
        say("applying tiny-llama on the local pool: its pods are real kvpilot-runtime processes")
        self.kubectl("apply", "-f", "-", input=json.dumps(manifest))
        self.wait_for(lambda: self.is_ready(TINY), 300, "tiny-llama to be Ready")
        print(self.kubectl("get", "modeldeployments"))

    def load_burst(self) -> dict[str, Any]:
        url = self.endpoint()
        result, dataset = self.workdir / "bench.json", self.workdir / "tenants.jsonl"
        records = tenant_prompts(TENANTS, REQUESTS_PER_TENANT, OUTPUT_LEN)
        dataset.write_text("".join(json.dumps(r) + "\n" for r in records))
        say(
            f"load burst through the gateway: kvpilot bench, 32 concurrent streams, {TENANTS}"
            f" tenants x {REQUESTS_PER_TENANT} requests sharing a preamble per tenant"
        )
        before = self.routing_counters()
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
                "--dataset",
                str(dataset),
                "--num-prompts",
                str(len(records)),
                "--output-len",
                str(OUTPUT_LEN),
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
        self.routing = {
            name: growth(before[name], now) for name, now in self.routing_counters().items()
        }
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
        self.routing_summary()

    def routing_summary(self) -> None:
        if not self.routing:
            print("\n  routing figures: need the dev cluster (pod IPs of the gateway and replicas)")
            return
        figures = self.routing
        say("routing through the gateway (its pods' kvpilot_gateway_* and the replicas' counters)")
        print(table(routing_rows(figures["picks"], figures["hits"], figures["queries"])))
        print(
            f"  answers by status code: {by_key(figures['codes'])};"
            f" retries: {by_key(figures['retries'])}; fallbacks: {by_key(figures['fallbacks'])}"
        )

    # -- helpers -----------------------------------------------------------------------------

    def status(self, name: str) -> dict[str, Any]:
        found = self.cluster.kubectl("get", "modeldeployment", name, "-o", "json", check=False)
        return dict(json.loads(found.stdout).get("status", {})) if found.returncode == 0 else {}

    def is_ready(self, name: str) -> bool:
        """Whether `name` has a Ready replica. Its pods failing (a runtime that cannot start
        crash-loops) is an error with the operator's reason: the rest of the wait could only
        hide it."""
        status = self.status(name)
        failing = pods_failing(status)
        if failing is not None:
            raise DevClusterError(f"{name}'s pods fail: {failing}")
        return int(status.get("readyReplicas", 0)) >= 1

    def endpoint(self) -> str:
        """The gateway Service's base URL: one OpenAI endpoint for every model."""
        namespace, service = self.gateway_service()
        if self.own_cluster:  # Service IPs route nowhere here: the dev cluster's service proxy
            url = closedloop.start_proxy(self.cluster, GATEWAY_PROXY, service, namespace)
        else:
            port = procs.free_port()
            subprocess.Popen(
                ["kubectl", "port-forward", "-n", namespace, f"svc/{service}", f"{port}:80"],
                env=self.cluster.env,
                stdout=subprocess.DEVNULL,
            )
            url = f"http://127.0.0.1:{port}"
        self.wait_for(lambda: procs.http_ok(f"{url}/v1/models"), 60, "the gateway endpoint")
        models = [m["id"] for m in json.load(urllib.request.urlopen(f"{url}/v1/models"))["data"]]
        print(f"  OPENAI_BASE_URL={url}/v1  (Service {namespace}/{service}; models: {models})")
        return url

    def gateway_service(self) -> tuple[str, str]:
        """(namespace, name) of kvpilot-gateway's Service: the demo's release on its own
        cluster, else the one the chart installed (found by its labels)."""
        if self.own_cluster:
            return RELEASE_NAMESPACE, chart.gateway_service(
                self.cluster, RELEASE, RELEASE_NAMESPACE
            )
        found = self.get("services", "-A", "-l", chart.GATEWAY)["items"]
        if not found:
            raise DevClusterError(
                "no kvpilot-gateway Service in this cluster: install the chart with"
                " gateway.enabled=true (the default)"
            )
        return found[0]["metadata"]["namespace"], found[0]["metadata"]["name"]

    def routing_counters(self) -> dict[str, dict[str, float]]:
        """The gateway pods' and the replicas' counters now (on the dev cluster, where pod IPs
        are reachable; nothing elsewhere)."""
        if not self.own_cluster:
            return {}
        gateways = scrape(chart.gateway_pod_urls(self.cluster, RELEASE, RELEASE_NAMESPACE))
        picks = counter_sums(list(gateways.values()), "kvpilot_gateway_picks", "backend")
        replicas = scrape(self.replica_urls())
        hits = per_replica(replicas, "kvpilot_prefix_cache_hits")
        queries = per_replica(replicas, "kvpilot_prefix_cache_queries")
        texts = list(gateways.values())
        return {
            "picks": picks,
            "hits": hits,
            "queries": queries,
            "codes": counter_sums(texts, "kvpilot_gateway_requests", "code"),
            "retries": counter_sums(texts, "kvpilot_gateway_retries", "reason"),
            "fallbacks": counter_sums(texts, "kvpilot_gateway_fallbacks", "reason"),
        }

    def replica_urls(self) -> dict[str, str]:
        """`namespace/pod` (the gateway's name for a replica) -> URL of each running replica."""
        urls = {}
        for pod in self.get("pods", "-l", f"kvpilot.dev/model={TINY}")["items"]:
            ip = pod["status"].get("podIP")
            ports = pod["spec"]["containers"][0].get("ports") or []
            port = next((p["containerPort"] for p in ports if p.get("name") == "http"), None)
            if ip and port and pod["status"].get("phase") == "Running":
                urls[f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"] = (
                    f"http://{ip}:{port}"
                )
        return urls

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


def pods_failing(status: dict[str, Any]) -> str | None:
    """The operator's account of failing pods (its Degraded condition, reason PodsFailing: a
    container in CrashLoopBackOff or an image that cannot be pulled), None while there is none."""
    conditions = {c.get("type"): c for c in status.get("conditions", [])}
    degraded = conditions.get("Degraded", {})
    if degraded.get("status") == "True" and degraded.get("reason") == "PodsFailing":
        return str(degraded.get("message", ""))
    return None


def per_replica(texts: dict[str, str], family: str) -> dict[str, float]:
    """replica -> the sum of a counter family in its /metrics text."""
    return {
        name: counter_sums([text], family, None).get("all", 0.0) for name, text in texts.items()
    }


def scrape(urls: dict[str, str]) -> dict[str, str]:
    """name -> /metrics text of each URL that answers (a replica may just be going away)."""
    texts = {}
    for name, url in urls.items():
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
                texts[name] = resp.read().decode()
        except OSError:
            continue
    return texts


def plan_rows(plan: list[dict[str, Any]]) -> list[list[str]]:
    """status.plan as the demo's table: LOSS % is the level's measured quality loss on the
    user's eval set (spec.quantization.evaluation), `-` where not measured, as in
    `kubectl get md -o wide`."""
    rows = [
        ["NODE TYPE", "FITS", "QUANT", "LOSS %", "TP", "WEIGHTS", "KV", "MAX SEQS", "$/H", "WHY"]
    ]
    for entry in plan:
        loss = entry.get("qualityLoss")
        rows.append(
            [
                entry["nodeType"],
                "yes" if entry["fits"] else "no",
                entry.get("quantization") or "-",
                "-" if loss is None else f"{loss:+.2f}",
                str(entry.get("tensorParallel") or "-"),
                f"{entry.get('weightsGiB', 0):.1f}Gi",
                f"{entry.get('kvCacheGiB', 0):.1f}Gi",
                str(entry.get("maxConcurrency") or "-"),
                f"{entry.get('pricePerHour', 0):.2f}",
                entry.get("reason", ""),
            ]
        )
    return rows


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
        tiny_llama = tiny_llama_manifest()  # a checkout its pods cannot read fails here, first
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
        demo.serve_tiny_llama(tiny_llama)
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
