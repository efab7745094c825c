"""Pure pieces of the pod runner: argv and env for a container, pod IPs, status documents.

Each pod gets a loopback IP from its node's 127.x podCIDR and its process binds to that IP, which
is how several pods listen on the same container port on one machine (no network namespaces).
"""

from __future__ import annotations

import ipaddress
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

FIELD_REFS = {
    "metadata.name": lambda pod, ip: pod["metadata"]["name"],
    "metadata.namespace": lambda pod, ip: pod["metadata"]["namespace"],
    "metadata.uid": lambda pod, ip: pod["metadata"].get("uid", ""),
    "spec.nodeName": lambda pod, ip: pod["spec"].get("nodeName", ""),
    "status.podIP": lambda pod, ip: ip,
    "status.hostIP": lambda pod, ip: "127.0.0.1",
}


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def next_pod_ip(pod_cidr: str, taken: set[str]) -> str:
    """The lowest free host address of the node's podCIDR (the .1 is left to the 'node')."""
    network = ipaddress.ip_network(pod_cidr)
    for address in list(network.hosts())[1:]:
        if str(address) not in taken:
            return str(address)
    raise ValueError(f"podCIDR {pod_cidr} has no free address left ({len(taken)} taken)")


def container_env(pod: dict[str, Any], container: dict[str, Any], pod_ip: str) -> dict[str, str]:
    """Literal values and downward-API field refs; other sources are not available locally."""
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = str(var["value"])
        field = (var.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        if field in FIELD_REFS:
            env[var["name"]] = FIELD_REFS[field](pod, pod_ip)
    return env


def container_argv(container: dict[str, Any], pod_ip: str, bin_dirs: list[Path]) -> list[str]:
    """command + args, the executable resolved locally, and `--host` bound to the pod's IP."""
    argv = [*(container.get("command") or []), *(container.get("args") or [])]
    if not argv:
        raise ValueError(f"container {container['name']} has no command: a local pod needs one")
    argv[0] = resolve_executable(argv[0], bin_dirs)
    if "--host" in argv:
        argv[argv.index("--host") + 1] = pod_ip
    else:
        argv += ["--host", pod_ip]
    return argv


def resolve_executable(name: str, bin_dirs: list[Path]) -> str:
    if "/" in name:
        return name
    for folder in bin_dirs:
        if (folder / name).is_file():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        raise ValueError(f"executable {name!r} not found in {[str(d) for d in bin_dirs]} or PATH")
    return found


def probe_url(probe: dict[str, Any] | None, container: dict[str, Any], pod_ip: str) -> str | None:
    """http URL of an httpGet probe; a named port is looked up in the container's ports."""
    http = (probe or {}).get("httpGet")
    if not http:
        return None
    port = http["port"]
    if isinstance(port, str) and not port.isdigit():
        port = next(p["containerPort"] for p in container.get("ports", []) if p.get("name") == port)
    return f"http://{pod_ip}:{port}{http.get('path', '/')}"


def running_status(
    pod: dict[str, Any], pod_ip: str, ready: bool, restarts: int, started_at: str
) -> dict[str, Any]:
    container = pod["spec"]["containers"][0]
    flag = "True" if ready else "False"
    stamp = now()
    return {
        "phase": "Running",
        "hostIP": "127.0.0.1",
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": pod.get("status", {}).get("startTime") or started_at,
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp},
            {"type": "Initialized", "status": "True", "lastTransitionTime": stamp},
            {"type": "ContainersReady", "status": flag, "lastTransitionTime": stamp},
            {"type": "Ready", "status": flag, "lastTransitionTime": stamp},
        ],
        "containerStatuses": [
            {
                "name": container["name"],
                "image": container.get("image", ""),
                "imageID": "",
                "ready": ready,
                "started": True,
                "restartCount": restarts,
                "state": {"running": {"startedAt": started_at}},
            }
        ],
    }


def terminated_status(pod: dict[str, Any], exit_code: int, restarts: int) -> dict[str, Any]:
    container = pod["spec"]["containers"][0]
    stamp = now()
    return {
        "phase": "Succeeded" if exit_code == 0 else "Failed",
        "conditions": [
            {"type": "ContainersReady", "status": "False", "lastTransitionTime": stamp},
            {"type": "Ready", "status": "False", "lastTransitionTime": stamp},
        ],
        "containerStatuses": [
            {
                "name": container["name"],
                "image": container.get("image", ""),
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": restarts,
                "state": {"terminated": {"exitCode": exit_code, "finishedAt": stamp}},
            }
        ],
    }


def should_restart(restart_policy: str, exit_code: int) -> bool:
    return restart_policy == "Always" or (restart_policy == "OnFailure" and exit_code != 0)


def pre_stop_command(container: dict[str, Any]) -> list[str] | None:
    exec_action = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec")
    return list(exec_action["command"]) if exec_action else None


def node_ready_status() -> dict[str, Any]:
    stamp = now()
    return {
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "LocalPodRunnerReady",
                "message": "hack/podrunner runs this node's pods as local processes",
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }
        ],
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
    }
