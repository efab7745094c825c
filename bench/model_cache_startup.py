"""A new replica's start-up on real pods: model fetched by the pod vs read from the model cache.

    .venv/bin/python -m bench.model_cache_startup [--repeats 3]

Brings up the dev cluster in a temp dir (control plane, pod runner, the Hugging Face hub serving
`kvpilot/tiny-llama`), starts the operator, and creates two ModelDeployments of
hf://kvpilot/tiny-llama on the `local` pool, one replica each: `per-pod` (every pod's init
container fetches the model) and `cached` (spec.model.cache: a Job filled a claim once; pods
mount it). Then, interleaved, it deletes each one's pod and times until the replacement is Ready
(what a rescheduled replica costs), and afterwards, interleaved too, times a scale-up onto a free
GPU (what the autoscaler pays): the other variant scaled to 0 through its spec, this one's
replicas written 1 -> 2, until the new pod is Ready; then both are put back. Also reported: the
cache's one-off fill (status.cache).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config

from bench import pod_phases
from bench.report import markdown_table, write_section
from hack.closedloop import apply_crds
from hack.devcluster.cluster import DevCluster
from kvpilot.contract import k8s, resource

ROOT = Path(__file__).resolve().parents[1]
URI = "hf://kvpilot/tiny-llama"
FACTS = {"parameters": 3819776, "layers": 4, "kvHeads": 2, "headDim": 32, "vocabSize": 4096}


def model_deployment(name: str, env: dict[str, str], cached: bool) -> dict[str, Any]:
    model: dict[str, Any] = {"uri": URI, "servedName": "tiny", **FACTS}
    if cached:
        model["cache"] = {"size": "1Gi"}
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": model,
            "serving": {"maxContextLength": 256, "targetConcurrency": 2},
            "placement": {"nodeTypes": ["local"]},
            "autoscaling": {"mode": "off", "replicas": 1},
            "runtime": {"env": [{"name": "HF_ENDPOINT", "value": env["HF_ENDPOINT"]}]},
        },
    }


def get(cluster: DevCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def ready_pods(cluster: DevCluster, name: str) -> list[str]:
    found = get(cluster, "pods", "-n", "default", "-l", f"kvpilot.dev/model={name}")["items"]
    return [
        p["metadata"]["name"]
        for p in found
        if not p["metadata"].get("deletionTimestamp")
        and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions", [])
        )
    ]


def wait_ready(cluster: DevCluster, name: str, timeout: float = 300) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = ready_pods(cluster, name)
        if found:
            return found
        time.sleep(0.1)
    raise TimeoutError(f"{name}: no Ready pod within {timeout} s")


@dataclass(frozen=True)
class PodStart:
    """One new pod, from what started it (a delete, a write of the replicas) to its Ready."""

    seconds: float  # the delete or the write sent -> the new pod's Ready seen by a watch
    phases: dict[str, float]  # pod_phases.PHASES or pod_phases.SCALE_UP_PHASES

    @property
    def own_start_s(self) -> float:
        """Scheduled -> Ready: the new pod's own start, without what came before its binding."""
        return sum(self.phases[phase] for phase in pod_phases.OWN_START_PHASES)


def followed_to_ready(
    watched: pod_phases.PodWatch, started_at: float, names: tuple[str, ...]
) -> PodStart:
    """The first pod created after `started_at`, followed to Ready, phase by phase."""
    seen = watched.wait_ready(started_at, timeout_s=300)
    process_created, engine_ready = pod_phases.runtime_startup(seen.pod)
    assert seen.ready is not None  # wait_ready returns a pod seen Ready
    return PodStart(
        seen.ready - started_at,
        pod_phases.phases(started_at, seen, process_created, engine_ready, names),
    )


def replacement(watched: pod_phases.PodWatch, cluster: DevCluster, name: str) -> PodStart:
    """Delete the replica's pod and follow its replacement to Ready, phase by phase."""
    (old,) = wait_ready(cluster, name)
    core = client.CoreV1Api(watched.core.api_client)
    deleted_at = time.time()
    core.delete_namespaced_pod(old, "default")
    return followed_to_ready(watched, deleted_at, pod_phases.PHASES)


def set_replicas(objects: client.CustomObjectsApi, name: str, replicas: int) -> float:
    """Write the ModelDeployment's spec.autoscaling.replicas (mode off); the unix time just
    before the write."""
    written_at = time.time()
    objects.patch_namespaced_custom_object(
        resource.GROUP,
        resource.VERSION,
        "default",
        resource.PLURAL,
        name,
        {"spec": {"autoscaling": {"replicas": replicas}}},
        _content_type=k8s.MERGE_PATCH,
    )
    return written_at


def wait_settled(core: client.CoreV1Api, name: str, count: int, timeout: float = 300) -> list[str]:
    """Wait until the model has exactly `count` pods, all Ready, none being deleted; their names.
    Polled every 0.5 s, only between the timed parts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = core.list_namespaced_pod("default", label_selector=f"kvpilot.dev/model={name}")
        pods = [core.api_client.sanitize_for_serialization(p) for p in listed.items]
        if pod_phases.is_settled(pods, count):
            return [p["metadata"]["name"] for p in pods]
        time.sleep(0.5)
    raise TimeoutError(f"{name}: not {count} Ready pod(s) and no other within {timeout} s")


def scale_up(
    watched: pod_phases.PodWatch, objects: client.CustomObjectsApi, name: str, other: str
) -> PodStart:
    """Free a GPU (`other` to 0 replicas), write `name`'s replicas 1 -> 2 and follow the new pod
    to Ready, phase by phase; then `name` back to 1 and `other` back to 1."""
    core = watched.core
    set_replicas(objects, other, 0)
    wait_settled(core, other, 0)
    (old,) = wait_settled(core, name, 1)
    written_at = set_replicas(objects, name, 2)
    start = followed_to_ready(watched, written_at, pod_phases.SCALE_UP_PHASES)
    if watched.is_deleted(old):  # a new pod template: a rollout would have replaced it
        raise RuntimeError(f"{name}: pod {old} was deleted by the write of replicas 2")
    set_replicas(objects, name, 1)
    wait_settled(core, name, 1)
    set_replicas(objects, other, 1)
    wait_settled(core, other, 1)
    return start


@dataclass(frozen=True)
class Results:
    replacements: dict[str, list[PodStart]]  # by variant
    scale_ups: dict[str, list[PodStart]]  # by variant
    cache: dict[str, Any]  # the cached variant's status.cache (its one-off fill)


def run(repeats: int) -> Results:
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-") as work:
        cluster = DevCluster(Path(work) / "cluster")
        cluster.up()
        operator = None
        try:
            apply_crds(cluster)
            log = (Path(work) / "operator.log").open("wb")
            operator = subprocess.Popen(
                [str(ROOT / ".venv" / "bin" / "kvpilot-operator"), "run"],
                env=cluster.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            env = cluster.client_env()
            for name, cached in (("per-pod", False), ("cached", True)):
                doc = json.dumps(model_deployment(name, env, cached))
                cluster.kubectl("apply", "-n", "default", "-f", "-", input=doc)
            for name in ("per-pod", "cached"):
                wait_ready(cluster, name)
            cache = get(cluster, "modeldeployment", "cached", "-n", "default")["status"]["cache"]
            api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
            return measure(cluster, api, repeats, cache)
        finally:
            if operator is not None:
                operator.terminate()
                operator.wait(timeout=30)
            cluster.down()


def measure(
    cluster: DevCluster, api: client.ApiClient, repeats: int, cache: dict[str, Any]
) -> Results:
    """The replacements, then the scale-ups, each `repeats` times interleaved over the variants
    (so a change in the machine's load hits both)."""
    variants = ("per-pod", "cached")
    replacements: dict[str, list[PodStart]] = {name: [] for name in variants}
    # cached first: the autoscaler's case; each frees the GPU the other variant holds
    scale_ups: dict[str, list[PodStart]] = {"cached": [], "per-pod": []}
    objects = client.CustomObjectsApi(api)
    with contextlib.ExitStack() as watches:
        watched = {
            name: watches.enter_context(
                pod_phases.PodWatch(api, "default", f"kvpilot.dev/model={name}")
            )
            for name in variants
        }
        for _ in range(repeats):
            for name, starts in replacements.items():
                starts.append(replacement(watched[name], cluster, name))
        for _ in range(repeats):
            for name, starts in scale_ups.items():
                other = next(v for v in variants if v != name)
                starts.append(scale_up(watched[name], objects, name, other))
    return Results(replacements, scale_ups, cache)


def phases_table(
    runs: dict[str, list[PodStart]],
    names: tuple[str, ...] = pod_phases.PHASES,
    total: str = "delete -> Ready (total)",
) -> str:
    """Each phase's median per variant, the new pod's own start (scheduled -> Ready), the total."""
    rows = [[phase, *(median([r.phases[phase] for r in reps]) for reps in runs.values())]
            for phase in names]  # fmt: skip
    rows += [
        ["scheduled -> Ready (the new pod's own start)",
         *(median([r.own_start_s for r in reps]) for reps in runs.values())],
        [total, *(median([r.seconds for r in reps]) for reps in runs.values())],
    ]  # fmt: skip
    return markdown_table(["seconds (median)", *runs], rows)


def scale_up_report(scale_ups: dict[str, list[PodStart]]) -> str:
    """The scale-ups' Ready (median and each run), their phases, and what the phases hold."""
    rows = [[name, median([r.seconds for r in reps]), " ".join(f"{r.seconds:.2f}" for r in reps)]
            for name, reps in scale_ups.items()]  # fmt: skip
    table = markdown_table(["model reaches the pod", "scale-up Ready s", "runs"], rows)
    phases = phases_table(scale_ups, pod_phases.SCALE_UP_PHASES, "written -> Ready (total)")
    return f"{table}\n\nBy phase:\n\n{phases}\n\n{SCALE_UP_NOTE}"


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}"


# What `created -> scheduled` holds here: both `local` nodes' one GPU is taken (one replica of
# each variant), so the new pod waits for the old one's process to exit and its object to go;
# the deletion requeues it and kube-scheduler binds it (0.39 s median on 2026-12-07, under the
# 1 s initial back-off: the wait is the old pod's exit, not the back-off).
WAITS_FOR_THE_GPU = (
    "`created -> scheduled` is the old pod's exit: the `local` pool's two nodes have one GPU "
    "each and both hold a replica, so the replacement is unschedulable until the old pod is "
    "gone; its deletion requeues the replacement and kube-scheduler binds it. A "
    "real kubelet would also run the pod's preStop sleep (5 s) first, which the pod runner "
    "skips; a scale-up onto a free GPU has no such wait (measured on its own below). "
    "`scheduled -> Ready` is the new pod's own start."
)


# What the scale-up measures, and what it leaves out.
SCALE_UP_NOTE = (
    "A scale-up onto a free GPU, the autoscaler's case: the other variant is scaled to 0 "
    "replicas through its spec (`spec.autoscaling.replicas`, mode off) and its pod is gone, "
    "then this one's `spec.autoscaling.replicas` is written 1 -> 2 and timed to the new pod's "
    "Ready; then it goes back to 1 and the other to 1 again. `written -> created` is the "
    "operator's reconcile of the write (its plan, its apply of the Deployment's replicas) and "
    "the Deployment and ReplicaSet controllers; `created -> scheduled` is kube-scheduler's "
    "binding with a GPU free; `scheduled -> Ready` is the new pod's own start, as in a "
    "replacement."
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = run(args.repeats)
    runs, cache = results.replacements, results.cache
    seconds = {name: [r.seconds for r in reps] for name, reps in runs.items()}
    per_pod = statistics.median(seconds["per-pod"])
    rows = [
        [
            name,
            f"{statistics.median(values):.2f}",
            " ".join(f"{v:.2f}" for v in values),
            f"{statistics.median(values) / per_pod:.2f}x",
        ]
        for name, values in seconds.items()
    ]
    table = markdown_table(
        ["model reaches the pod", "replacement Ready s (median)", "runs", "vs per-pod fetch"], rows
    )
    body = (
        f"hf://kvpilot/tiny-llama (7.6 MiB) on the dev cluster's `local` pool (pods are real "
        f"processes), one replica each, {args.repeats} interleaved runs: a replica's pod is "
        "deleted and the time until its replacement is Ready is measured (scheduling, the "
        "fetch init container where there is one, runtime start-up and load, readiness probe). "
        f"The cache's one-off fill: {cache.get('files')} files, {cache.get('bytes')} bytes in "
        f"{cache.get('durationSeconds')} s (status.cache).\n\n{table}\n\n"
        f"By phase (bench/pod_phases.py; per-pod's fetch is in `scheduled -> process created`):"
        f"\n\n{phases_table(runs)}\n\n{WAITS_FOR_THE_GPU}\n\n"
        f"Scale-up onto a free GPU ({args.repeats} runs, interleaved, after the "
        f"replacements):\n\n{scale_up_report(results.scale_ups)}\n\n"
        "On a 7.6 MiB model the difference is the fetch process's start-up and verification; "
        "on a 15 GB checkpoint each per-pod replica downloads 15 GB while a cached one reads "
        "local storage (bench.model_load has fetch vs local load)."
    )
    write_section(
        "model_cache_startup",
        "Model cache: a new replica's start-up, fetched per pod vs from the cache",
        "python -m bench.model_cache_startup",
        body,
    )
    print(table)
    print(phases_table(runs))
    print(scale_up_report(results.scale_ups))


if __name__ == "__main__":
    main()
