"""Pieces the demo, the e2e tests and the closed-loop benchmark share: a tiny-llama
ModelDeployment for the `local` pool, a proxy in front of its Service, and a bench command."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from hack.devcluster import DevCluster, chart, procs
from hack.devcluster.errors import DevClusterError
from hack.devcluster.versions import REPO_ROOT
from kvpilot.operator.reconcile.manifests import SCRATCH_MOUNT

BIN = Path(sys.executable).parent


def tiny_llama(name: str, max_num_seqs: int, autoscaling: dict[str, Any]) -> dict[str, Any]:
    """examples/tiny-llama.yaml with this checkout's model path, a batch cap and a policy.

    A small batch per replica makes a modest burst queue, which is what the autoscaler scales on.
    """
    doc = yaml.safe_load((REPO_ROOT / "examples" / "tiny-llama.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["model"]["uri"] = local_model_uri(REPO_ROOT / "models" / "tiny-llama")
    doc["spec"]["model"]["servedName"] = name
    doc["spec"]["serving"]["maxNumSeqs"] = max_num_seqs
    doc["spec"]["autoscaling"] = autoscaling
    return dict(doc)


def local_model_uri(path: Path) -> str:
    """The file:// URI of `path` for runtime pods of the `local` pool: real processes that read
    this machine's files, except under their volumes' mount paths, as a container sees its
    volume there and not the image. Their scratch emptyDir hides this machine's /tmp, so a
    checkout there could never load: said up front, not as a crash-looping pod."""
    scratch = Path(SCRATCH_MOUNT)
    if path.is_relative_to(scratch):
        raise DevClusterError(
            f"{path} is under {scratch}, where kvpilot's runtime pods mount an emptyDir that hides "
            f"it from them: clone the repository outside {scratch} and run this from there"
        )
    return f"file://{path}"


def apply_crds(cluster: DevCluster) -> None:
    """The project's CRDs (crds/: ModelDeployment), applied and Established."""
    crds = str(REPO_ROOT / "crds")
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", crds)
    wait_established(cluster, crds)


def wait_established(cluster: DevCluster, crds: str, timeout_s: float = 60) -> None:
    """`kubectl wait` fails at once, instead of waiting, while a fresh CRD has no status yet
    (".status.conditions accessor error: <nil>"): under load the apiserver writes it a moment
    after the apply. Wait again until Established or the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(1, int(deadline - time.monotonic()))
        done = cluster.kubectl(
            "wait", "--for=condition=Established", f"--timeout={left}s", "-f", crds, check=False
        )
        if done.returncode == 0:
            return
        if "accessor error" not in done.stderr or time.monotonic() >= deadline:
            raise DevClusterError(f"CRDs in {crds} not Established: {done.stderr.strip()}")
        time.sleep(0.5)


def builtin_autoscaling(max_replicas: int, down_window_s: int) -> dict[str, Any]:
    return {
        "mode": "builtin",
        "minReplicas": 1,
        "maxReplicas": max_replicas,
        "targetQueueLength": 2,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": down_window_s,
    }


def start_proxy(cluster: DevCluster, process: str, service: str, namespace: str = "default") -> str:
    """hack.serviceproxy in front of `service`, as a process `down` stops; its base URL."""
    port = procs.free_port()
    cluster.start_process(
        process,
        [
            sys.executable,
            "-m",
            "hack.serviceproxy",
            f"--kubeconfig={cluster.kubeconfig}",
            f"--namespace={namespace}",
            f"--service={service}",
            f"--port={port}",
        ],
    )
    return f"http://127.0.0.1:{port}"


def start_operator(cluster: DevCluster, process: str, interval_s: int) -> None:
    """`kvpilot-operator run --standalone` beside the cluster (a process `down` stops), its
    autoscaler reading the dev cluster's Prometheus every `interval_s` seconds."""
    env = {
        **cluster.env,
        "KVPILOT_PROMETHEUS_URL": cluster.prometheus_url,
        "KVPILOT_AUTOSCALER_INTERVAL": str(interval_s),
    }
    argv = [str(BIN / "kvpilot-operator"), "run", "--standalone"]
    cluster.start_process(process, argv, env=env)


def bench_argv(url: str, model: str, concurrency: int, prompts: int, result: Path) -> list[str]:
    """`kvpilot bench` with short fixed-length requests (EOS ignored), JSON to `result`."""
    return [
        str(BIN / "kvpilot"),
        "bench",
        "--base-url",
        url,
        "--model",
        model,
        "--concurrency",
        str(concurrency),
        "--num-prompts",
        str(prompts),
        "--input-len",
        "32",
        "--output-len",
        "64",
        "--ignore-eos",
        "--result-json",
        str(result),
        "--no-progress",
    ]


def zero_autoscaling(idle_s: int) -> dict[str, Any]:
    """Builtin autoscaling 0..1 that goes to zero after `idle_s` seconds without requests."""
    return {
        "mode": "builtin",
        "minReplicas": 0,
        "maxReplicas": 1,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 5,
        "scaleToZeroIdleSeconds": idle_s,
    }


def start_zero_gateway(cluster: DevCluster, name: str, idle_s: int, fallback_after_s: int) -> str:
    """`start_gateway` with a tiny-llama ModelDeployment `name` that may go to zero."""
    md = tiny_llama(name, 4, zero_autoscaling(idle_s))  # refuses a checkout pods cannot read
    # The CRD defaults spec.routing.fallbackAfterSeconds (30 s), which the gateway takes over its
    # own --fallback-after: a cold start that may take longer says so here.
    md["spec"]["routing"] = {"fallbackAfterSeconds": fallback_after_s}
    return start_gateway(cluster, md)


def start_gateway(cluster: DevCluster, md: dict[str, Any]) -> str:
    """CRDs, the operator, the chart's gateway (`helm install`, release `<name>-gw` in the default
    namespace: two gateway pods on the `local` pool watching the cluster), the ModelDeployment
    `md` (named `name`), and a proxy in front of the gateway's Service (`stop_zero_gateway`
    undoes it all, also when a step here fails: an operator left running would hold the
    leader-election Lease and act in later tests); the proxy's base URL once the gateway
    answers."""
    name = md["metadata"]["name"]
    apply_crds(cluster)
    start_operator(cluster, f"{name}-operator", 2)
    try:
        chart.helm_install(cluster, zero_release(name), "default")
        cluster.kubectl("apply", "-f", "-", input=json.dumps(md))
        service = chart.gateway_service(cluster, zero_release(name), "default")
        url = start_proxy(cluster, f"{name}-gateway-proxy", service)
        if not procs.wait_for(lambda: procs.http_ok(f"{url}/health"), 120, 0.5):
            raise RuntimeError(f"the chart's gateway did not answer on {url}/health within 120 s")
    except BaseException:
        stop_zero_gateway(cluster, name)
        raise
    return url


def zero_release(name: str) -> str:
    return f"{name}-gw"


def stop_zero_gateway(cluster: DevCluster, name: str) -> None:
    cluster.kubectl("delete", "modeldeployment", name, "--wait=false", check=False)
    cluster.stop_process(f"{name}-gateway-proxy")
    cluster.stop_process(f"{name}-operator")
    uninstall = ["uninstall", zero_release(name), "--wait", "--timeout", "60s"]
    chart.helm(cluster, *uninstall, "--namespace", "default", check=False)


def md_status(cluster: DevCluster, name: str) -> dict[str, Any]:
    """The ModelDeployment's status; {} while it has none or does not exist."""
    out = cluster.kubectl("get", "modeldeployment", name, "-o", "json", check=False)
    return dict(json.loads(out.stdout).get("status", {})) if out.returncode == 0 else {}


def model_pods(cluster: DevCluster, name: str) -> list[dict[str, Any]]:
    """The ModelDeployment's runtime pods (label kvpilot.dev/model)."""
    out = cluster.kubectl(
        "get", "pods", "-l", f"kvpilot.dev/model={name}", "-o", "json", check=False
    )
    return list(json.loads(out.stdout)["items"]) if out.returncode == 0 else []
