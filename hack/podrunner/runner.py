"""The pod runner's loop: heartbeat local nodes, start/probe/restart/stop their pods' processes.

Each tick reads the whole state afresh (every POLL_S), which keeps it small and self-healing; it
ticks at once when a pod of a local node changes (a watch per node) or a container's process
exits, as the kubelet acts on its pod watch and its container events, so a pod bound to the node,
an init container done or an old pod's process gone costs no poll period. It is a test and demo
stand-in for the kubelet, not a kubelet.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

from hack.images import checkout
from hack.podrunner import apiaccess, images, pods
from hack.podrunner.imagestore import ImageNotReadyError, ImagePullError, ImageStore, Unpacked
from hack.podrunner.provisioner import Provisioner

LOCAL_NODE_SELECTOR = "kvpilot.dev/local-execution=true"
POLL_S = 0.5
HEARTBEAT_S = 10.0
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0)
ENTER_SCRIPT = Path(images.__file__).with_name("enter.py")
HOST_TOOLS_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"  # unshare, mount: the host's own


@dataclass
class LocalPod:
    """One pod's process and what the runner last reported for it."""

    namespace: str
    name: str
    pod_ip: str
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: str = ""
    ready: bool = False
    next_probe: float = 0.0
    last_read: dict[str, Any] = field(default_factory=dict)  # the pod as the last tick read it
    restart_at: float | None = None
    terminating: bool = False
    exit_code: int | None = None
    num_inits_done: int = 0
    pod_dir: Path = Path()
    volumes: dict[str, Path] = field(default_factory=dict)
    # When the projected volumes (the ServiceAccount token) are next filled; None: never yet.
    projected_renew_at: float | None = None
    # Images mode: the process is `unshare`, the container is its child (PID 1 of its namespace);
    # the container's user owns the projected files, which it could not read as root's 0600.
    plan: images.ContainerPlan | None = None
    reported: dict[str, Any] = field(default_factory=dict)


class PodRunner:
    def __init__(
        self,
        api: client.ApiClient,
        log_dir: Path,
        bin_dirs: list[Path],
        state_dir: Path | None = None,
        image_store: ImageStore | None = None,
        node_paths: tuple[Path, ...] = (),
    ) -> None:
        self.core = client.CoreV1Api(api)
        # Images mode: containers of kvpilot's images run from the images' filesystems.
        self.image_store = image_store
        self.node_paths = node_paths  # seen read-only at the same path by image containers
        # Volumes live here: emptyDirs per pod, claims shared by the pods that mount them.
        self.state_dir = state_dir or log_dir.parent / "podrunner"
        self.coordination = client.CoordinationV1Api(api)
        self.log_dir = log_dir
        self.bin_dirs = bin_dirs
        self.pods: dict[str, LocalPod] = {}  # by pod uid
        # The runner is also the dev cluster's storage: it serves the default StorageClass.
        self.provisioner = Provisioner(api, self.state_dir / "claims")
        self.last_heartbeat = 0.0
        # Set by a local node's pod watch or an exited process: the loop ticks without waiting.
        self.wake = threading.Event()
        self.watched_nodes: set[str] = set()
        self.stop = threading.Event()

    # -- loop ----------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self.stop = stop
        threading.Thread(target=self.wake_on_stop, daemon=True).start()
        while not stop.is_set():
            self.wake.clear()  # before the tick: a change during it brings the next one
            try:
                self.probe_due()
                self.tick()
            except (ApiException, urllib.error.URLError, OSError) as err:
                print(f"podrunner: {err}", flush=True)  # the apiserver may be restarting
            probes_due = [p.next_probe for p in self.pods.values()]
            self.wake.wait(until_next_tick(time.monotonic(), probes_due))
        self.shutdown()

    def tick(self) -> None:
        self.provisioner.tick()
        nodes = [
            self.as_dict(n) for n in self.core.list_node(label_selector=LOCAL_NODE_SELECTOR).items
        ]
        for name in {n["metadata"]["name"] for n in nodes} - self.watched_nodes:
            self.watched_nodes.add(name)
            threading.Thread(target=self.watch_node_pods, args=(name,), daemon=True).start()
        if time.monotonic() - self.last_heartbeat >= HEARTBEAT_S:
            for node in nodes:
                self.heartbeat(node["metadata"]["name"])
            self.last_heartbeat = time.monotonic()
        seen: set[str] = set()
        for node in nodes:
            selector = f"spec.nodeName={node['metadata']['name']}"
            for pod in self.core.list_pod_for_all_namespaces(field_selector=selector).items:
                doc = self.as_dict(pod)
                seen.add(doc["metadata"]["uid"])
                self.sync(doc, node["spec"]["podCIDR"])
        for uid in set(self.pods) - seen:  # force-deleted from the API: stop the process
            self.kill(self.pods.pop(uid))

    def probe_due(self) -> None:
        """The probes due now, on the pods as last read, before the tick lists them afresh: a
        kubelet's probe workers keep their own period and wait for no list of the node's pods."""
        now = time.monotonic()
        for local in list(self.pods.values()):
            running = local.proc is not None and local.proc.poll() is None
            # next_probe 0: never probed yet; the first probe is the tick's, after the start
            due = 0.0 < local.next_probe <= now
            if running and due and local.last_read and not local.terminating:
                self.probe(local.last_read, local.last_read["spec"]["containers"][0], local)

    def wake_on_stop(self) -> None:
        self.stop.wait()
        self.wake.set()

    def watch_node_pods(self, node_name: str) -> None:
        """Wake the loop whenever a pod of this node changes (created, bound here, deleted)."""
        while not self.stop.is_set():
            try:
                for _event in watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces,
                    field_selector=f"spec.nodeName={node_name}",
                    timeout_seconds=300,
                    deserialize=False,  # only that it changed: the tick reads the pods
                ):
                    self.wake.set()
            except (ApiException, HTTPError, OSError):
                self.stop.wait(1.0)  # the apiserver may be restarting; the poll goes on

    def wake_on_exit(self, proc: subprocess.Popen[bytes]) -> None:
        """A thread waiting for the process: its exit ticks the loop (a crash restarted, an init
        container's successor started, a deleted pod's object removed, each without a poll)."""

        def wait() -> None:
            proc.wait()
            self.wake.set()

        threading.Thread(target=wait, daemon=True).start()

    def as_dict(self, obj: object) -> dict[str, Any]:
        """Plain camelCase dicts, as in the API's JSON: easier to read than the client's models."""
        return dict(self.core.api_client.sanitize_for_serialization(obj))

    # -- nodes ---------------------------------------------------------------------------------

    def heartbeat(self, node_name: str) -> None:
        self.core.patch_node_status(node_name, {"status": pods.node_ready_status()})
        renew = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # a MicroTime
        spec = {"holderIdentity": node_name, "leaseDurationSeconds": 40, "renewTime": renew}
        try:
            self.coordination.patch_namespaced_lease(node_name, "kube-node-lease", {"spec": spec})
        except ApiException as err:
            if err.status != 404:
                raise
            lease = client.V1Lease(
                metadata=client.V1ObjectMeta(name=node_name, namespace="kube-node-lease"),
                spec=client.V1LeaseSpec(
                    holder_identity=node_name,
                    lease_duration_seconds=40,
                    renew_time=datetime.now(UTC),
                ),
            )
            self.coordination.create_namespaced_lease("kube-node-lease", lease)

    # -- pods ----------------------------------------------------------------------------------

    def sync(self, pod: dict[str, Any], pod_cidr: str) -> None:
        uid = pod["metadata"]["uid"]
        local = self.pods.get(uid)
        if local is None:
            if pod["status"].get("phase") in ("Succeeded", "Failed"):
                return
            local = self.pods[uid] = self.admit(pod, pod_cidr)
        if pod["metadata"].get("deletionTimestamp"):
            self.sync_terminating(pod, local)
        else:
            self.sync_running(pod, local)

    def admit(self, pod: dict[str, Any], pod_cidr: str) -> LocalPod:
        taken = {p.pod_ip for p in self.pods.values()}
        ip = pod["status"].get("podIP") or pods.next_pod_ip(pod_cidr, taken)
        pod_dir = self.state_dir / "pods" / pod["metadata"]["uid"]
        volumes = pods.volume_dirs(pod, pod_dir, self.state_dir / "claims")
        for folder in volumes.values():
            folder.mkdir(parents=True, exist_ok=True)
        if self.image_store is not None:  # writable by the container's user, as the kubelet's
            for name in pods.writable_volumes(pod):
                volumes[name].chmod(0o777)
        meta = pod["metadata"]
        for volume in pod["spec"].get("volumes") or []:
            if "configMap" in volume:
                self.project_config_map(meta["namespace"], volume, volumes[volume["name"]])
        return LocalPod(meta["namespace"], meta["name"], ip, pod_dir=pod_dir, volumes=volumes)

    def sync_running(self, pod: dict[str, Any], local: LocalPod) -> None:
        inits = pod["spec"].get("initContainers") or []
        while local.num_inits_done < len(inits):  # one done: the next starts in this tick
            num_done = local.num_inits_done
            self.sync_init(pod, inits[num_done], local)
            if local.num_inits_done == num_done:
                return
        container = pod["spec"]["containers"][0]
        local.last_read = pod
        if local.restart_at is not None:  # crashed: restart once the back-off is over
            if time.monotonic() >= local.restart_at:
                local.restarts += 1
                self.start(pod, container, local)
        elif local.proc is None and local.exit_code is None:
            self.start(pod, container, local)
        elif local.proc is not None and local.proc.poll() is not None:
            self.on_exit(pod, local, local.proc.returncode)
        elif local.proc is not None and time.monotonic() >= local.next_probe:
            self.probe(pod, container, local)
        if local.projected_renew_at is not None and time.monotonic() >= local.projected_renew_at:
            try:
                self.fill_projected(pod, local)
            except ValueError as err:  # the old token stays until it expires: retry
                print(f"podrunner: {local.namespace}/{local.name}: {err}", flush=True)

    def sync_init(self, pod: dict[str, Any], container: dict[str, Any], local: LocalPod) -> None:
        """Init containers run one after the other, each to exit 0, before the app container;
        a failed one restarts with back-off (restartPolicy Always), as the kubelet does."""
        if local.restart_at is not None:
            if time.monotonic() >= local.restart_at and self.launch(pod, container, local):
                local.restarts += 1
                self.report_init(pod, local, {"running": {"startedAt": pods.now()}})
        elif local.proc is None:
            if self.launch(pod, container, local):
                self.report_init(pod, local, {"running": {"startedAt": pods.now()}})
        elif local.proc.poll() is not None:
            code, local.proc = local.proc.returncode, None
            if code == 0:
                local.num_inits_done, local.restarts = local.num_inits_done + 1, 0
                return
            backoff = RESTART_BACKOFF_S[min(local.restarts, len(RESTART_BACKOFF_S) - 1)]
            local.restart_at = time.monotonic() + backoff
            message = self.termination_message(container, local)
            failed = {"terminated": {"exitCode": code, "reason": "Error", "message": message}}
            status = pods.initializing_status(
                pod,
                local.pod_ip,
                local.num_inits_done,
                {"waiting": {"reason": "CrashLoopBackOff"}},
                local.restarts,
            )
            status["initContainerStatuses"][local.num_inits_done]["lastState"] = failed
            self.report(pod, local, status)

    def report_init(self, pod: dict[str, Any], local: LocalPod, state: dict[str, Any]) -> None:
        status = pods.initializing_status(
            pod, local.pod_ip, local.num_inits_done, state, local.restarts
        )
        self.report(pod, local, status)

    def start(self, pod: dict[str, Any], container: dict[str, Any], local: LocalPod) -> None:
        if not self.launch(pod, container, local):
            return
        local.started_at = pods.now()
        self.report(
            pod,
            local,
            pods.running_status(pod, local.pod_ip, False, local.restarts, local.started_at),
        )

    def launch(self, pod: dict[str, Any], container: dict[str, Any], local: LocalPod) -> bool:
        """The container's process, with its volumes as local directories (or, in images mode,
        bind-mounted into its image's filesystem); False when its config cannot be resolved (a
        missing Secret: retried, as CreateContainerConfigError), or its image is not there."""
        local.restart_at, local.ready, local.exit_code = None, False, None
        log = self.log_path(local)
        log.parent.mkdir(parents=True, exist_ok=True)
        # The termination log is a file the kubelet mounts into the container; here a local file.
        message_file = self.termination_file(local, container)
        message_file.parent.mkdir(parents=True, exist_ok=True)
        message_file.write_text("")
        message_file.chmod(0o666)  # as the kubelet makes it: any container user writes it
        ref = self.image_ref(container)
        try:
            if ref is None or self.image_store is None:
                argv, env = self.host_command(pod, container, local, message_file)
            else:
                image = self.image_store.get(ref, str(container["image"]))
                argv, env = self.image_command(pod, container, local, image, message_file)
            if local.projected_renew_at is None:
                self.fill_projected(pod, local)
        except ImageNotReadyError as err:
            self.wait_for_image(pod, container, local, str(err))
            return False
        except ImagePullError as err:
            self.refuse(pod, container, local, str(err), "ErrImagePull")
            return False
        except ValueError as err:
            self.refuse(pod, container, local, str(err))
            return False
        with log.open("ab") as out:
            local.proc = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self.wake_on_exit(local.proc)
        return True

    def host_command(
        self, pod: dict[str, Any], container: dict[str, Any], local: LocalPod, message_file: Path
    ) -> tuple[list[str], dict[str, str]]:
        """A local process of the host's venv: mount paths in its args and env rewritten to the
        volumes' directories, KUBECONFIG naming its ServiceAccount's token."""
        local.plan = None
        mounts = pods.container_mounts(container, local.volumes)
        mounts.append((pods.termination_message_path(container), str(message_file)))
        own_env = pods.container_env(pod, container, local.pod_ip, self.read_secret, mounts)
        entrypoint = images.host_entrypoint(str(container.get("image", "")))
        argv = pods.container_argv(container, local.pod_ip, self.bin_dirs, mounts, entrypoint)
        api_env = apiaccess.api_env(self.api_server, self.write_kubeconfig(pod, local, mounts))
        env = {**apiaccess.inherited_env(os.environ), **api_env, **own_env}
        env["PATH"] = os.pathsep.join([*map(str, self.bin_dirs), os.environ.get("PATH", "")])
        return argv, env

    # -- images mode (images.py, imagestore.py, enter.py) --------------------------------------

    def image_ref(self, container: dict[str, Any]) -> images.ImageRef | None:
        if self.image_store is None:
            return None
        return images.parse_reference(str(container.get("image", "")), build_version())

    def image_command(
        self,
        pod: dict[str, Any],
        container: dict[str, Any],
        local: LocalPod,
        image: Unpacked,
        message_file: Path,
    ) -> tuple[list[str], dict[str, str]]:
        """`unshare` running enter.py on the container's plan: the image's filesystem, the
        pod's volumes at their mountPaths, in-cluster API access through the mounted token."""
        mounts = [
            *images.node_path_mounts(self.node_paths),
            *images.volume_mounts(container, local.volumes, message_file),
        ]
        own_env = pods.container_env(pod, container, local.pod_ip, self.read_secret)
        env = {**apiaccess.api_env(self.api_server, None), **own_env}
        container_dir = local.pod_dir / "containers" / container["name"]
        for layer in ("upper", "work"):  # each start gets a fresh top layer, as a new container
            shutil.rmtree(container_dir / layer, ignore_errors=True)
        layers = images.Layers(image.rootfs, container_dir)
        plan = images.plan(pod, container, image.as_image(), layers, mounts, env)
        plan = replace(plan, argv=images.bind_pod_ip(plan.argv, container, local.pod_ip))
        plan_file = container_dir / "plan.json"
        write_files(container_dir, {plan_file.name: json.dumps(plan.to_json())})  # 0600: secrets
        local.plan = plan
        unshare = images.unshare_argv("unshare", sys.executable, str(ENTER_SCRIPT), str(plan_file))
        return unshare, {"PATH": HOST_TOOLS_PATH}

    def wait_for_image(
        self, pod: dict[str, Any], container: dict[str, Any], local: LocalPod, why: str
    ) -> None:
        """ContainerCreating while the image is unpacked; the next tick tries again (and
        reports only a change: it runs every tick)."""
        waiting = {"waiting": {"reason": "ContainerCreating", "message": why}}
        if container in (pod["spec"].get("initContainers") or []):
            key = "initContainerStatuses"
            status = pods.initializing_status(
                pod, local.pod_ip, local.num_inits_done, waiting, local.restarts
            )
        else:
            key = "containerStatuses"
            status = pods.running_status(pod, local.pod_ip, False, local.restarts, pods.now())
            status["phase"] = "Pending"
            status["containerStatuses"][0]["state"] = waiting
        if local.reported.get(key) != status[key]:
            self.report(pod, local, status)

    # -- the pod's API access (apiaccess.py) ---------------------------------------------------

    @property
    def api_server(self) -> str:
        return str(self.core.api_client.configuration.host)

    def fill_projected(self, pod: dict[str, Any], local: LocalPod) -> None:
        """Fill the pod's projected volumes (its ServiceAccount token, the cluster's CA, its
        namespace) as the kubelet does: before its first container, again before the token
        expires. A ValueError names what is missing (the kubelet's FailedMount)."""
        sources = apiaccess.Sources(
            token=lambda audiences, seconds: self.request_token(pod, audiences, seconds),
            config_map=self.read_config_map,
            secret=self.read_secret,
        )
        lifetimes = []
        owner = (local.plan.uid, local.plan.gid) if local.plan else None
        for volume in apiaccess.projected_volumes(pod):
            projection = apiaccess.project(volume, pod, sources)
            write_files(local.volumes[volume["name"]], projection.files, owner)
            if projection.token_lifetime_s is not None:
                lifetimes.append(projection.token_lifetime_s)
        renew_after = apiaccess.renew_after_s(min(lifetimes)) if lifetimes else math.inf
        local.projected_renew_at = time.monotonic() + renew_after

    def request_token(
        self, pod: dict[str, Any], audiences: list[str], seconds: int
    ) -> apiaccess.IssuedToken:
        """A TokenRequest for the pod's ServiceAccount, bound to the pod (invalid once the pod
        is deleted), as the kubelet makes for a projected serviceAccountToken."""
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        bound = client.V1BoundObjectReference(
            api_version="v1", kind="Pod", name=meta["name"], uid=meta["uid"]
        )
        spec = client.V1TokenRequestSpec(
            audiences=audiences, expiration_seconds=seconds, bound_object_ref=bound
        )
        try:
            answer = self.core.create_namespaced_service_account_token(
                account, meta["namespace"], client.AuthenticationV1TokenRequest(spec=spec)
            )
        except ApiException as err:
            if err.status == 404:
                raise ValueError(f'serviceaccount "{account}" not found') from err
            raise
        status = answer.status
        if status is None or not status.token:
            raise ValueError(f'the TokenRequest for serviceaccount "{account}" returned no token')
        expires = status.expiration_timestamp
        lifetime = (expires - datetime.now(UTC)).total_seconds() if expires else float(seconds)
        return apiaccess.IssuedToken(status.token, max(lifetime, 0.0))

    def read_config_map(self, namespace: str, name: str) -> dict[str, str] | None:
        try:
            return dict(self.core.read_namespaced_config_map(name, namespace).data or {})
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def write_kubeconfig(
        self, pod: dict[str, Any], local: LocalPod, mounts: list[tuple[str, str]]
    ) -> Path | None:
        """The pod's in-cluster kubeconfig (apiaccess.kubeconfig), when it mounts a token."""
        account_dir = apiaccess.service_account_dir(mounts)
        if account_dir is None:
            return None
        config = apiaccess.kubeconfig(self.api_server, account_dir, local.namespace)
        path = local.pod_dir / "kubeconfig"
        write_files(local.pod_dir, {path.name: yaml.safe_dump(config, sort_keys=False)})
        return path

    def refuse(
        self,
        pod: dict[str, Any],
        container: dict[str, Any],
        local: LocalPod,
        why: str,
        reason: str = "CreateContainerConfigError",
    ) -> None:
        local.restart_at = time.monotonic() + RESTART_BACKOFF_S[-1]
        waiting = {"waiting": {"reason": reason, "message": why}}
        is_init = container in (pod["spec"].get("initContainers") or [])
        if is_init:
            self.report_init(pod, local, waiting)
            return
        status = pods.running_status(pod, local.pod_ip, False, local.restarts, pods.now())
        status["phase"] = "Pending"
        status["containerStatuses"][0]["state"] = waiting
        self.report(pod, local, status)

    def project_config_map(self, namespace: str, volume: dict[str, Any], folder: Path) -> None:
        """Write the ConfigMap's keys as files, as the kubelet does (a missing one leaves the
        folder empty: the process then says what it could not find)."""
        try:
            found = self.core.read_namespaced_config_map(volume["configMap"]["name"], namespace)
        except ApiException as err:
            if err.status == 404:
                return
            raise
        files = pods.config_map_files(volume, found.data or {}, found.binary_data or {})
        for path, content in files.items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_bytes(content)

    def read_secret(self, namespace: str, name: str) -> dict[str, str] | None:
        try:
            secret = self.core.read_namespaced_secret(name, namespace)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        data = secret.data or {}
        return {key: base64.b64decode(value).decode() for key, value in data.items()}

    def log_path(self, local: LocalPod) -> Path:
        return self.log_dir / f"{local.namespace}_{local.name}.log"

    def log_tail(self, local: LocalPod) -> str:
        try:
            with self.log_path(local).open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def termination_file(self, local: LocalPod, container: dict[str, Any]) -> Path:
        return local.pod_dir / "termination" / container["name"]

    def termination_message(
        self, container: dict[str, Any], local: LocalPod, exit_code: int = 1
    ) -> str:
        try:
            written = self.termination_file(local, container).read_text(errors="replace")
        except OSError:
            written = ""
        return pods.termination_message(container, self.log_tail(local), written, exit_code)

    def probe(self, pod: dict[str, Any], container: dict[str, Any], local: LocalPod) -> None:
        probe = container.get("readinessProbe")
        url = pods.probe_url(probe, container, local.pod_ip)
        period = float((probe or {}).get("periodSeconds", 10))
        period = period if local.ready else min(period, 1.0)
        local.next_probe = next_probe_at(local.next_probe, time.monotonic(), period)
        ready = url is None or http_ok(url, float((probe or {}).get("timeoutSeconds", 1)))
        if ready != local.ready:
            local.ready = ready
            self.report(
                pod,
                local,
                pods.running_status(pod, local.pod_ip, ready, local.restarts, local.started_at),
            )

    def on_exit(self, pod: dict[str, Any], local: LocalPod, code: int) -> None:
        local.proc, local.ready = None, False
        policy = pod["spec"].get("restartPolicy", "Always")
        if pods.should_restart(policy, code):
            backoff = RESTART_BACKOFF_S[min(local.restarts, len(RESTART_BACKOFF_S) - 1)]
            local.restart_at = time.monotonic() + backoff
            status = pods.running_status(pod, local.pod_ip, False, local.restarts, local.started_at)
            status["containerStatuses"][0]["state"] = {
                "waiting": {"reason": "CrashLoopBackOff", "message": f"exited with code {code}"}
            }
            message = self.termination_message(pod["spec"]["containers"][0], local)
            status["containerStatuses"][0]["lastState"] = {
                "terminated": {"exitCode": code, "finishedAt": pods.now(), "message": message}
            }
        else:
            local.exit_code = code
            message = self.termination_message(pod["spec"]["containers"][0], local, code)
            status = pods.terminated_status(pod, code, local.restarts, message)
        self.report(pod, local, status)

    def sync_terminating(self, pod: dict[str, Any], local: LocalPod) -> None:
        if local.proc is not None and local.proc.poll() is None:
            if not local.terminating:
                local.terminating = True
                grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
                container = pod["spec"]["containers"][0]
                threading.Thread(
                    target=terminate, args=(local.proc, container, grace, local.plan), daemon=True
                ).start()
            return
        # The process is gone: finish the deletion as the kubelet does, with grace 0.
        try:
            self.core.delete_namespaced_pod(local.name, local.namespace, grace_period_seconds=0)
        except ApiException as err:
            if err.status != 404:
                raise
        self.pods.pop(pod["metadata"]["uid"], None)
        # emptyDirs go with the pod; claims stay, as a bound volume outlives its pods.
        shutil.rmtree(self.state_dir / "pods" / pod["metadata"]["uid"], ignore_errors=True)

    def report(self, pod: dict[str, Any], local: LocalPod, status: dict[str, Any]) -> None:
        local.reported = status
        try:
            self.core.patch_namespaced_pod_status(local.name, local.namespace, {"status": status})
        except ApiException as err:
            if err.status != 404:
                raise

    def kill(self, local: LocalPod) -> None:
        if local.proc is not None and local.proc.poll() is None:
            terminate(local.proc, {}, 5.0, local.plan)

    def shutdown(self) -> None:
        """Stopping the runner stops its pods' processes (SIGTERM, then SIGKILL)."""
        threads = [threading.Thread(target=self.kill, args=(p,)) for p in self.pods.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def terminate(
    proc: subprocess.Popen[bytes],
    container: dict[str, Any],
    grace_s: float,
    plan: images.ContainerPlan | None = None,
) -> None:
    """preStop hook, then SIGTERM, then SIGKILL when the grace period is over. In images mode
    `proc` is `unshare`, which passes no signal on: SIGTERM goes to its child, the container's
    PID 1; the SIGKILL to unshare takes the whole namespace (--kill-child)."""
    deadline = time.monotonic() + grace_s
    command = pods.pre_stop_command(container)
    init_pid = namespace_init_pid(proc) if plan is not None else proc.pid
    if command and plan is not None:  # run inside the container, as its user
        command = images.exec_argv(init_pid or proc.pid, plan, command)
    if command:
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            subprocess.run(
                command,
                timeout=max(0.0, deadline - time.monotonic()),
                check=False,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=plan.env if plan is not None else None,
            )
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(init_pid or proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def namespace_init_pid(proc: subprocess.Popen[bytes]) -> int | None:
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text()
    except OSError:
        return None
    return images.namespace_init_pid(children)


@functools.cache
def build_version() -> str:
    """The tag a kvpilot image without one gets: the version `make images` builds."""
    return checkout.version()


def write_files(folder: Path, files: dict[str, str], owner: tuple[int, int] | None = None) -> None:
    """Each file replaced at once (write, then rename), so a reader never sees half a token;
    readable by its owner alone (the container's user, in images mode)."""
    folder.mkdir(parents=True, exist_ok=True)
    for relative, content in files.items():
        target = folder / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial")
        partial.write_text(content)
        partial.chmod(0o600)
        if owner is not None:
            os.chown(partial, *owner)
        os.replace(partial, target)


def until_next_tick(now: float, probes_due: list[float], poll_s: float = POLL_S) -> float:
    """Seconds to the next tick: the poll period, or less when a probe falls due first, so a
    starting pod's Ready follows its /ready by the probe period, not that plus a poll. Probes
    already due (a pod still in its init containers is never probed) wait for the poll."""
    ahead = [due - now for due in probes_due if due > now]
    return min([poll_s, *ahead])


def next_probe_at(due: float, now: float, period_s: float) -> float:
    """When a probe run at `now` (due at `due`; 0: never run) is next due: on its own period's
    ticks, as a kubelet's probe ticker, so a late run does not push every later probe back; ticks
    missed while it was late are skipped, as a Go ticker drops them."""
    if due <= 0.0:
        return now + period_s
    num_periods = max(1, math.floor((now - due) / period_s) + 1)
    return due + num_periods * period_s


def http_ok(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return bool(200 <= resp.status < 400)
    except (urllib.error.URLError, OSError, ValueError):
        return False
