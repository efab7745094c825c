"""The kvpilot chart on the dev cluster, installed as a user installs it: `helm upgrade
--install` with chart-values.yaml, which puts the gateway's pods on the `local` pool (real
processes run by hack/podrunner, each acting as the gateway's ServiceAccount)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hack.devcluster.errors import DevClusterError
from hack.devcluster.versions import HELM, REPO_ROOT

if TYPE_CHECKING:
    from hack.devcluster.cluster import DevCluster

CHART = REPO_ROOT / "charts" / "kvpilot"
VALUES = Path(__file__).with_name("chart-values.yaml")
GATEWAY = "app.kubernetes.io/component=gateway"


def helm_install(
    cluster: DevCluster,
    release: str,
    namespace: str,
    timeout_s: int = 300,
    settings: Sequence[str] = (),
) -> None:
    """Install (or upgrade) the chart and wait until its gateway pods are Ready; `settings`: more
    helm flags, after the dev cluster's values (e.g. `--set-json` `gateway.extraArgs=[...]`)."""
    args = ["upgrade", "--install", release, str(CHART), "--namespace", namespace]
    args += ["--create-namespace", "--values", str(VALUES), "--wait", "--timeout", f"{timeout_s}s"]
    helm(cluster, *args, *settings)


def gateway_service(cluster: DevCluster, release: str, namespace: str) -> str:
    """The name of the release's gateway Service: the one OpenAI endpoint."""
    selector = f"{GATEWAY},app.kubernetes.io/instance={release}"
    found = cluster.kubectl("get", "services", "-n", namespace, "-l", selector, "-o", "json")
    names = [item["metadata"]["name"] for item in json.loads(found.stdout)["items"]]
    if len(names) != 1:
        raise DevClusterError(f"release {release} has {len(names)} gateway Services: {names}")
    return str(names[0])


def gateway_pod_urls(cluster: DevCluster, release: str, namespace: str) -> dict[str, str]:
    """Pod name -> http://<pod IP>:<port> of each running gateway pod (for its /metrics)."""
    selector = f"{GATEWAY},app.kubernetes.io/instance={release}"
    found = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json")
    urls = {}
    for pod in json.loads(found.stdout)["items"]:
        ip = pod["status"].get("podIP")
        port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
        if ip and not pod["metadata"].get("deletionTimestamp"):
            urls[pod["metadata"]["name"]] = f"http://{ip}:{port}"
    return urls


def helm(cluster: DevCluster, *args: str, check: bool = True) -> str:
    """The pinned helm against the cluster; its output (a DevClusterError when it fails)."""
    done = subprocess.run(
        [str(HELM.path("helm")), *args],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if check and done.returncode != 0:
        raise DevClusterError(f"helm {' '.join(args[:2])} failed: {done.stderr.strip()}")
    return done.stdout + done.stderr
