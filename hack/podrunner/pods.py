"""Pure pieces of the pod runner: argv and env for a container, pod IPs, status documents.

Each pod gets a loopback IP from its node's 127.x podCIDR and its process binds to that IP, which
is how several pods listen on the same container port on one machine (no network namespaces).
"""

from __future__ import annotations

import base64
import ipaddress
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
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


SecretReader = Callable[[str, str], dict[str, str] | None]  # (ns, name) -> data, None: absent


def container_env(
    pod: dict[str, Any],
    container: dict[str, Any],
    pod_ip: str,
    read_secret: SecretReader | None = None,
    mounts: Sequence[tuple[str, str]] = (),
) -> dict[str, str]:
    """envFrom Secrets, literal values, downward-API field refs and Secret key refs, as the
    kubelet resolves them; a missing Secret or key is a ValueError (CreateContainerConfigError).
    Values naming a mount path are rewritten to the volume's local directory."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        if "secretRef" in source:
            env.update(_secret(read_secret, namespace, source["secretRef"]["name"]))
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = rewrite_paths(str(var["value"]), mounts)
        ref = var.get("valueFrom") or {}
        field = ref.get("fieldRef", {}).get("fieldPath")
        if field in FIELD_REFS:
            env[var["name"]] = FIELD_REFS[field](pod, pod_ip)
        if "secretKeyRef" in ref:
            secret, key = ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"]
            data = _secret(read_secret, namespace, secret)
            if key not in data:
                raise ValueError(f"couldn't find key {key} in Secret {namespace}/{secret}")
            env[var["name"]] = data[key]
    return env


def _secret(read_secret: SecretReader | None, namespace: str, name: str) -> dict[str, str]:
    data = read_secret(namespace, name) if read_secret else None
    if data is None:
        raise ValueError(f'secret "{name}" not found')
    return data


def volume_dirs(pod: dict[str, Any], pod_dir: Path, claims_dir: Path) -> dict[str, Path]:
    """Each volume as a local directory: an emptyDir per pod; a PersistentVolumeClaim per claim,
    shared by every pod that mounts it (as a volume bound to that claim is); hostPath as is."""
    namespace = pod["metadata"]["namespace"]
    dirs: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes") or []:
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            dirs[volume["name"]] = claims_dir / namespace / claim
        elif "hostPath" in volume:
            dirs[volume["name"]] = Path(volume["hostPath"]["path"])
        else:  # emptyDir, and the projected/config volumes a local process does not need
            dirs[volume["name"]] = pod_dir / "volumes" / volume["name"]
    return dirs


def writable_volumes(pod: dict[str, Any]) -> list[str]:
    """The volumes a container's user writes to: emptyDirs (the kubelet makes them 0777) and
    claims (rancher's local-path-provisioner makes their directories 0777 too)."""
    volumes = pod["spec"].get("volumes") or []
    return [v["name"] for v in volumes if "emptyDir" in v or "persistentVolumeClaim" in v]


def config_map_files(
    volume: dict[str, Any], data: Mapping[str, str], binary_data: Mapping[str, str | bytes]
) -> dict[str, bytes]:
    """What the kubelet projects into a configMap volume: every key as a file of its name, or
    only the listed items at their paths (binaryData is base64 in the API)."""
    files = {key: text.encode() for key, text in data.items()}
    files.update({key: base64.b64decode(b64) for key, b64 in binary_data.items()})
    items = volume["configMap"].get("items")
    if not items:
        return files
    return {item["path"]: files[item["key"]] for item in items if item["key"] in files}


def container_mounts(container: dict[str, Any], dirs: dict[str, Path]) -> list[tuple[str, str]]:
    """(mountPath, local directory) of the container's mounts, the longest paths first so that
    /mnt/models/x wins over /mnt/models."""
    mounts = []
    for mount in container.get("volumeMounts") or []:
        local = dirs[mount["name"]] / mount.get("subPath", "")
        mounts.append((mount["mountPath"].rstrip("/"), str(local).rstrip("/")))
    return sorted(mounts, key=lambda m: len(m[0]), reverse=True)


def rewrite_paths(text: str, mounts: Sequence[tuple[str, str]]) -> str:
    """A process cannot see a mount at /mnt/models; each mount path in `text` (at a path
    boundary) becomes its local directory, the way the container would have seen it."""
    if not mounts:
        return text
    # One pass, so a local directory that itself starts with a mount path (/tmp) is never
    # rewritten again; the longest path first, so /mnt/models/x wins over /mnt/models.
    local_dirs = dict(mounts)
    alternatives = "|".join(re.escape(path) for path in sorted(local_dirs, key=len, reverse=True))
    # A path ends at a separator, the end, a space, an `=` or a quote (a JSON value in a flag).
    pattern = rf"(?<![\w.-])({alternatives})(?=/|$|\s|=|[\"'])"
    return re.sub(pattern, lambda found: local_dirs[found.group(1)], text)


def container_argv(
    container: dict[str, Any],
    pod_ip: str,
    bin_dirs: list[Path],
    mounts: Sequence[tuple[str, str]] = (),
    entrypoint: Sequence[str] = (),
) -> list[str]:
    """command + args (`entrypoint`, the image's, where the container has no command), the
    executable resolved locally, mount paths rewritten, and a serving container (one with ports)
    bound to the pod's IP with `--host`."""
    command = container.get("command") or list(entrypoint)
    if not command:
        raise ValueError(
            f"container {container['name']} has no command and its image"
            f" {container.get('image')!r} is not one kvpilot builds: a local pod needs one"
        )
    argv = [*command, *(container.get("args") or [])]
    argv = [argv[0]] + [rewrite_paths(arg, mounts) for arg in argv[1:]]
    argv[0] = resolve_executable(argv[0], bin_dirs)
    if not container.get("ports"):
        return argv
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
    status = _app_status(pod, pod_ip, ready, restarts, started_at)
    inits = pod["spec"].get("initContainers") or []
    if inits:  # the app container runs only after every init container exited 0
        completed = {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": now()}}
        status["initContainerStatuses"] = [_container_status(c, completed, 0) for c in inits]
    return status


def _app_status(
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


def terminated_status(
    pod: dict[str, Any], exit_code: int, restarts: int, message: str = ""
) -> dict[str, Any]:
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
                "state": {
                    "terminated": {
                        "exitCode": exit_code,
                        "reason": "Completed" if exit_code == 0 else "Error",
                        "finishedAt": stamp,
                        "message": message,
                    }
                },
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


def initializing_status(
    pod: dict[str, Any], pod_ip: str, index: int, state: dict[str, Any], restarts: int
) -> dict[str, Any]:
    """Phase Pending while init container `index` is in `state`: the ones before it completed,
    the app containers wait in PodInitializing, as the kubelet reports it."""
    stamp = now()
    inits = pod["spec"].get("initContainers") or []
    done = {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": stamp}}
    waiting = {"waiting": {"reason": "PodInitializing"}}
    init_states = [
        done if i < index else state if i == index else waiting for i in range(len(inits))
    ]
    message = f"containers with incomplete status: [{inits[index]['name']}]"
    return {
        "phase": "Pending",
        "hostIP": "127.0.0.1",
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp},
            {
                "type": "Initialized",
                "status": "False",
                "reason": "ContainersNotInitialized",
                "message": message,
                "lastTransitionTime": stamp,
            },
            {"type": "ContainersReady", "status": "False", "lastTransitionTime": stamp},
            {"type": "Ready", "status": "False", "lastTransitionTime": stamp},
        ],
        "initContainerStatuses": [
            _container_status(c, s, restarts if i == index else 0)
            for i, (c, s) in enumerate(zip(inits, init_states, strict=True))
        ],
        "containerStatuses": [_container_status(c, waiting, 0) for c in pod["spec"]["containers"]],
    }


def _container_status(
    container: dict[str, Any], state: dict[str, Any], restarts: int
) -> dict[str, Any]:
    return {
        "name": container["name"],
        "image": container.get("image", ""),
        "imageID": "",
        "ready": False,
        "started": "running" in state,
        "restartCount": restarts,
        "state": state,
    }


def termination_message_path(container: dict[str, Any]) -> str:
    return str(container.get("terminationMessagePath") or "/dev/termination-log")


def termination_message(
    container: dict[str, Any], log_tail: str, written: str = "", exit_code: int = 1
) -> str:
    """What the kubelet puts in `terminated.message`: what the container wrote to its termination
    log; else, for a failure of a container that asks for it (FallbackToLogsOnError), the log's
    last lines; else nothing."""
    if written.strip():
        return written[-4096:]
    if exit_code == 0 or container.get("terminationMessagePolicy") != "FallbackToLogsOnError":
        return ""
    return "\n".join(log_tail.strip().splitlines()[-5:])[-4096:]
