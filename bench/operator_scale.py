"""200 ModelDeployments applied at once on ~100 kwok GPU nodes (issues 5 and 14 targets).

- time until all are Ready (target <= 30 s),
- reconcile latency p95, create returned -> Deployment seen by a watch (target <= 1 s),
- API writes per create, counted in the operator's process (bench.operator_writes; aim <= 3),
- operator RSS, current and peak (target <= 250 MB).

Runs the real operator (`kvpilot-operator run`) against a dev cluster it starts (or $KUBECONFIG),
adds kwok GPU nodes until there are ~100, creates the ModelDeployments from 8 client threads.
It does so `--bursts` times (3), each time into a fresh namespace with a freshly started
operator, and reports the burst with the median p95. With `--baseline REF` the operator of that
git revision (checked out into a temporary worktree) runs the same way on the same cluster, the
two in turn, and both are reported side by side.

    .venv/bin/python -m bench.operator_scale [--count 200] [--nodes 100] [--bursts 3]
        [--baseline REF] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client as k8s_client

from bench.report import command_line, markdown_table, write_section
from hack.closedloop import apply_crds
from hack.devcluster import DevCluster, nodepools
from kvpilot.contract import k8s, resource

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "bench-operator"
POOL = "bench-l4x4"
TARGETS = {"ready_s": 30.0, "p95_s": 1.0, "rss_mb": 250.0, "writes": 3.0}
IDLE_CREATES = 20


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def add_nodes(cluster: Any, total: int) -> int:
    existing = len(json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"])
    extra = max(0, total - existing)
    if not extra:
        return existing
    pool = nodepools.NodePool(
        POOL, extra, "48", "192Gi", 4.89, nodepools.Gpu("NVIDIA-L4", 23034, 4)
    )
    nodes = [nodepools.build_node(pool, i, 100) for i in range(extra)]
    doc = {"apiVersion": "v1", "kind": "List", "items": nodes}
    cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(doc), timeout=120)
    return existing + extra


def watch_first(
    list_fn: Callable[..., Any],
    args: tuple[Any, ...],
    is_done: Callable[[dict[str, Any]], bool],
    seen: dict[str, float],
    stop: threading.Event,
) -> None:
    """The first time each listed object is done, by the clock of this process. A watch, not a
    poll: a LIST of 200 ModelDeployments every 0.25 s cost the apiserver as much as an operator
    under test."""
    from kubernetes import watch
    from kubernetes.client.rest import ApiException

    version: dict[str, str] = {}  # where the last watch ended; empty: start with a listing
    while not stop.is_set():
        stream = watch.Watch()
        # Each watch resumes where the last ended and lasts a minute. One that ended every 5 s
        # and started afresh saw the objects made in between only once the new watch had sent
        # every object again: under the burst 70 Deployments at once, 1.5 s after the operator
        # had made them, and the p95 went from 0.9 to 2.8 s between runs. Resumed, the times
        # agree within 10 ms with those of a `kubectl get -w` run beside it.
        try:
            events = stream.stream(list_fn, *args, timeout_seconds=60, deserialize=False, **version)
            for event in events:
                obj = event["object"]
                version = {"resource_version": obj["metadata"]["resourceVersion"]}
                if is_done(obj):
                    seen.setdefault(obj["metadata"]["name"], time.monotonic())
                if stop.is_set():
                    stream.stop()
        except ApiException as error:
            if error.status != 410:  # 410: the version is too old; list afresh
                raise
            version = {}


def is_any(obj: dict[str, Any]) -> bool:
    return True


def is_ready(md: dict[str, Any]) -> bool:
    conditions = (md.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def model_deployment(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": k8s.MD_API_VERSION,
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"},
            "serving": {"maxContextLength": 4096, "targetConcurrency": 8},
            "placement": {"nodeTypes": [POOL]},
            "autoscaling": {"mode": "off", "replicas": 1},
        },
    }


def create_model_deployment(client: Any, name: str, namespace: str) -> None:
    # A leftover of that name would make its latency meaningless: fail rather than time it.
    if k8s.create(client, model_deployment(name, namespace)) is None:
        raise RuntimeError(f"ModelDeployment {namespace}/{name} exists already")


def rss_mb(pid: int) -> tuple[float, float]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


@dataclass
class Operator:
    """How to start one operator under test: its label in the report and its PYTHONPATH."""

    label: str
    slug: str  # in the run's namespace and file names
    pythonpath: str

    def start(self, cluster: Any, log: Path, writes: Path) -> subprocess.Popen[bytes]:
        env = {
            **cluster.env,
            "PYTHONPATH": f"{self.pythonpath}:{ROOT}",
            "KVPILOT_WRITES_FILE": str(writes),
        }
        # bench.operator_writes comes from this checkout (ROOT, last on the path); the operator
        # it runs comes from `pythonpath`, first on it.
        command = [sys.executable, "-m", "bench.operator_writes", "run"]
        with log.open("wb") as out:
            return subprocess.Popen(
                command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )


def tree_path(tree: Path) -> str:
    return ":".join(str(tree / part) for part in ("runtime", "operator", "gateway"))


def run(cluster: Any, operator: Operator, count: int, tmp: Path, burst: int) -> dict[str, Any]:
    """One burst of `count` creates into a fresh namespace and a freshly started operator."""
    slug = f"{operator.slug}-{burst}"
    namespace = f"{NAMESPACE}-{slug}"
    cluster.kubectl("create", "namespace", namespace, check=False)
    client = cluster.api_client()
    writes_file = tmp / f"writes-{slug}.json"
    log_file = tmp / f"operator-{slug}.log"
    process = operator.start(cluster, log_file, writes_file)
    seen: dict[str, float] = {}  # Deployment name -> first seen
    ready: dict[str, float] = {}  # ModelDeployment name -> first Ready
    stop = threading.Event()
    watches = (
        (k8s_client.AppsV1Api(client).list_namespaced_deployment, (namespace,), is_any, seen),
        (
            k8s_client.CustomObjectsApi(client).list_namespaced_custom_object,
            (resource.GROUP, resource.VERSION, namespace, resource.PLURAL),
            is_ready,
            ready,
        ),
    )
    for args in watches:
        threading.Thread(target=watch_first, args=(*args, stop), daemon=True).start()
    try:
        create_model_deployment(client, "warmup", namespace)
        wait_until(lambda: f"warmup-{POOL}" in seen, 120, "the operator to start acting")
        created: dict[str, float] = {}

        def create(name: str) -> None:
            create_model_deployment(client, name, namespace)
            created[name] = time.monotonic()

        start = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(create, [f"md-{i:03d}" for i in range(count)]))
        wait_until(lambda: all(n in ready for n in created), 600, f"{count} Ready")
        ready_s = max(ready[n] for n in created) - start
        wait_until(lambda: all(f"{n}-{POOL}" in seen for n in created), 60, "all Deployments seen")
        latencies = sorted(seen[f"{n}-{POOL}"] - t for n, t in created.items())
        idle = sorted(
            idle_latency(client, namespace, seen, f"one-{i:02d}") for i in range(IDLE_CREATES)
        )
        rss, peak = rss_mb(process.pid)
    except BaseException:
        log = log_file.read_text(errors="replace")
        print(f"operator log ({operator.label}), last lines:\n" + "\n".join(log.splitlines()[-30:]))
        raise
    finally:
        stop.set()
        process.terminate()
        process.wait(timeout=60)
        delete_namespace(cluster, namespace)
    counted = json.loads(writes_file.read_text()) if writes_file.exists() else {}
    writes = counted.get("writes", {})
    applies = counted.get("deployment_applies", {})
    (p50, p95), (idle_p50, idle_p95) = p50_p95(latencies), p50_p95(idle)
    return {
        "ready_s": ready_s,
        "p50_s": p50,
        "p95_s": p95,
        "max_s": latencies[-1],
        "rss_mb": rss,
        "peak_mb": peak,
        "idle_p50_s": idle_p50,
        "idle_p95_s": idle_p95,
        "writes": writes,
        "writes_per_create": sum(writes.values()) / (count + 1 + IDLE_CREATES),
        "parts": latency_parts(
            {f"{n}-{POOL}": t for n, t in created.items()},
            applies,
            seen,
        ),
    }


# Where a create's latency goes: (name, the part's start, its end), read from the create's
# return, the operator's apply of its Deployment (start, answer) and the bench's watch
PARTS = (
    ("create returned -> the operator sends the Deployment's apply", "created", "sent"),
    ("the apply's round trip (the apiserver's answer)", "sent", "answered"),
    ("apply answered -> the bench's watch sees the Deployment", "answered", "seen"),
)


def latency_parts(
    created: Mapping[str, float],
    applies: Mapping[str, Sequence[float]],
    seen: Mapping[str, float],
) -> dict[str, tuple[float, float]]:
    """p50 and p95 seconds of each of PARTS over the burst's Deployments (named as the keys of
    `created`) whose apply the operator timed; empty when it timed none (pure)."""
    moments = [
        {"created": created[name], "sent": applies[name][0], "answered": applies[name][1],
         "seen": seen[name]}
        for name in created
        if name in applies and name in seen
    ]  # fmt: skip
    if not moments:
        return {}
    return {
        label: p50_p95(sorted(m[end] - m[start] for m in moments)) for label, start, end in PARTS
    }


def p50_p95(ordered: Sequence[float]) -> tuple[float, float]:
    """The median and the 95th percentile (nearest rank) of sorted values (pure)."""
    return ordered[len(ordered) // 2], ordered[max(0, int(len(ordered) * 0.95) - 1)]


def median_burst(bursts: list[dict[str, Any]]) -> dict[str, Any]:
    """The burst whose create -> Deployment p95 is the median of the bursts' (all its figures
    from that burst), with every burst's p95 beside them (pure). One burst's p95 moves by a
    few hundred ms between runs of the same code on this shared machine."""
    ordered = sorted(bursts, key=lambda burst: burst["p95_s"])
    return {**ordered[len(ordered) // 2], "burst_p95s": [burst["p95_s"] for burst in bursts]}


def delete_namespace(cluster: Any, namespace: str) -> None:
    """Delete the run's namespace and wait for it: the next run needs the GPUs its pods hold."""
    cluster.kubectl("delete", "namespace", namespace, "--wait=true", check=False, timeout=300)


def idle_latency(client: Any, namespace: str, seen: dict[str, float], name: str) -> float:
    """Create one ModelDeployment into a settled operator and wait for its Deployment."""
    create_model_deployment(client, name, namespace)
    created = time.monotonic()
    wait_until(lambda: f"{name}-{POOL}" in seen, 60, f"{name}'s Deployment")
    return seen[f"{name}-{POOL}"] - created


def top_writes(writes: dict[str, int], per: int, most: int = 6) -> str:
    """The most frequent writes per create, e.g. 'PATCH deployments 1.0, POST events 1.0' (pure)."""
    ranked = sorted(writes.items(), key=lambda item: -item[1])[:most]
    return ", ".join(f"{name} {n / per:.1f}" for name, n in ranked)


def show_parts(parts: dict[str, tuple[float, float]]) -> str:
    """'part 12 / 40 ms; ...' (pure)."""
    shown = [f"{part} {ms(p50)} / {ms(p95)} ms" for part, (p50, p95) in parts.items()]
    return "; ".join(shown) or "not timed"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


# (figure, how a run shows it, the target as written, whether a run meets it)
FIGURES: list[
    tuple[str, Callable[[dict[str, Any]], str], str, Callable[[dict[str, Any]], bool]]
] = [
    (
        "all {count} Ready",
        lambda r: f"{r['ready_s']:.1f} s",
        "<= 30 s",
        lambda r: r["ready_s"] <= TARGETS["ready_s"],
    ),
    (
        "reconcile latency p95 (create -> Deployment)",
        lambda r: f"{ms(r['p95_s'])} ms (p50 {ms(r['p50_s'])}, max {ms(r['max_s'])})",
        "<= 1000 ms",
        lambda r: r["p95_s"] <= TARGETS["p95_s"],
    ),
    (
        "reconcile latency p95 of each burst",
        lambda r: ", ".join(ms(p95) for p95 in r["burst_p95s"]) + " ms",
        "",
        lambda r: True,
    ),
    (
        "reconcile latency p95, one at a time into a settled operator",
        lambda r: f"{ms(r['idle_p95_s'])} ms (p50 {ms(r['idle_p50_s'])})",
        "<= 1000 ms",
        lambda r: r["idle_p95_s"] <= TARGETS["p95_s"],
    ),
    (
        "API writes per create (operator's process)",
        lambda r: f"{r['writes_per_create']:.1f}",
        "<= 3",
        lambda r: r["writes_per_create"] <= TARGETS["writes"],
    ),
    (
        "operator RSS at the end (peak)",
        lambda r: f"{r['rss_mb']:.0f} MB ({r['peak_mb']:.0f} MB)",
        "<= 250 MB",
        lambda r: r["peak_mb"] <= TARGETS["rss_mb"],
    ),
]


def report(count: int, nodes: int, bursts: int, runs: dict[str, dict[str, Any]]) -> str:
    """One column per run; `met` is for the last one (this checkout)."""
    last = list(runs.values())[-1]
    rows: list[list[object]] = [
        [
            figure.format(count=count),
            *(show(r) for r in runs.values()),
            target,
            ("yes" if met(last) else "no") if target else "",
        ]
        for figure, show, target, met in FIGURES
    ]
    creates = count + 1 + IDLE_CREATES
    breakdown = "\n".join(
        f"- {label}: {top_writes(r['writes'], creates)}" for label, r in runs.items()
    )
    header = (
        f"{count} ModelDeployments created at once by 8 client threads on {nodes} kwok nodes;"
        f" control plane, kwok and operator share the machine's cores. Each operator ran {bursts}"
        " bursts on the same cluster, the operators in turn, each burst with a fresh operator"
        " process and namespace; a column shows the burst with the median p95 (all its figures"
        " from that burst). `met` is for the last column. The dev cluster's"
        " kube-controller-manager and kube-scheduler run with --kube-api-qps 200 and"
        " --kube-api-burst 400 (hack/devcluster/cluster.py); with the controller-manager's"
        " defaults (20 and 30) all 200 took ~47 s to turn Ready whichever operator ran (the run"
        " of 2026-12-04 19:03 UTC), the controllers' own rate limit.\n\n"
    )
    table = markdown_table(["figure", *runs, "target", "met"], rows)
    parts = "\n".join(f"- {label}: {show_parts(r['parts'])}" for label, r in runs.items())
    return (
        f"{header}{table}\n\nWrites per create, by kind:\n{breakdown}\n\n"
        "Where the burst's create -> Deployment latency goes, p50 / p95 of each part (the "
        "operator's process times its apply of each Deployment; the parts' p95s need not add "
        f"up to the whole's):\n{parts}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument(
        "--baseline", default="", help="a git revision whose operator runs first, for comparison"
    )
    parser.add_argument("--bursts", type=int, default=3, help="per operator; odd: a median")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-") as name:
        tmp = Path(name)
        operators = [Operator("this checkout", "current", tree_path(ROOT))]
        if args.baseline:
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(tmp / "baseline"), args.baseline],
                cwd=ROOT,
                check=True,
            )
            operators.insert(
                0, Operator(f"baseline {args.baseline}", "baseline", tree_path(tmp / "baseline"))
            )
        try:
            nodes, runs = on_cluster(tmp, operators, args.count, args.nodes, args.bursts)
        finally:
            if args.baseline:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(tmp / "baseline")],
                    cwd=ROOT,
                    check=False,
                )
    body = report(args.count, nodes, args.bursts, runs)
    print(body)
    if not args.no_write:
        command = command_line("bench.operator_scale", argv)
        write_section(
            "operator-scale", "Operator: 200 ModelDeployments on ~100 GPU nodes", command, body
        )
    return 0


def on_cluster(
    tmp: Path, operators: list[Operator], count: int, total_nodes: int, bursts: int
) -> tuple[int, dict[str, dict[str, Any]]]:
    """Each operator's run, in turn, on one cluster ($KUBECONFIG's, else a dev cluster)."""
    if os.environ.get("KUBECONFIG"):
        from hack.devcluster.existing import ExistingCluster

        cluster: Any = ExistingCluster(Path(os.environ["KUBECONFIG"]))
        return runs_on(cluster, tmp, operators, count, total_nodes, bursts)
    cluster = DevCluster(tmp / "cluster")
    try:
        cluster.up()
        return runs_on(cluster, tmp, operators, count, total_nodes, bursts)
    finally:
        cluster.down()


def runs_on(
    cluster: Any, tmp: Path, operators: list[Operator], count: int, total_nodes: int, bursts: int
) -> tuple[int, dict[str, dict[str, Any]]]:
    apply_crds(cluster)
    nodes = add_nodes(cluster, total_nodes)
    results: dict[str, list[dict[str, Any]]] = {operator.label: [] for operator in operators}
    for burst in range(bursts):  # the operators in turn, so a drift of the machine hits both
        for operator in operators:
            print(f"==> {operator.label}: {count} creates (burst {burst + 1})", flush=True)
            results[operator.label].append(run(cluster, operator, count, tmp, burst))
    return nodes, {label: median_burst(runs) for label, runs in results.items()}


if __name__ == "__main__":
    sys.exit(main())
