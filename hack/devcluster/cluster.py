"""The local control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok,
with the model servers a real cluster would reach (an S3 store and a Hugging Face hub).

Real binaries run as local processes (as controller-runtime's envtest does), with kwok standing in
for kubelets on fake GPU nodes. `up` is idempotent, `down` stops only the processes it started.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from hack.devcluster import build, imagesmode, modelsources, nodepools, pki, procs, prometheus
from hack.devcluster.errors import DevClusterError
from hack.devcluster.versions import (
    COMPONENTS,
    ETCD,
    KUBERNETES,
    KWOK,
    KWOK_STAGES,
    NODEPOOLS,
    REPO_ROOT,
    default_state_dir,
    kube_env,
)
from hack.images.spec import OPERATOR

# Start order; `down` stops in reverse.
PROCESSES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "podrunner",
    "prometheus",
    modelsources.S3_PROCESS,
    modelsources.HF_PROCESS,
)
SERVICE_CIDR = "10.96.0.0/16"
START_TIMEOUT_S = 120.0
# The controllers' client-side rate limits. kube-controller-manager's default (20 requests/s, burst
# 30, per controller) made 200 Deployments created at once take ~47 s to turn Ready whatever the
# operator did: each needs a ReplicaSet, a Pod, status updates and Events. Large clusters raise
# these; so does this one, as the API server here answers far faster than 20/s.
CONTROLLER_CLIENT_LIMITS = ("--kube-api-qps=200", "--kube-api-burst=400")


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    prometheus: int
    s3: int
    hf_hub: int


class DevCluster:
    """One dev cluster living in `state_dir` (pki, logs, pid files, etcd data, kubeconfig)."""

    def __init__(
        self,
        state_dir: Path | None = None,
        apiserver_port: int | None = None,
        images: bool = False,
    ) -> None:
        self.state_dir = (state_dir or default_state_dir()).resolve()
        self.requested_apiserver_port = apiserver_port
        # The `local` pool's pods run from the images `make images` built, not the host's venv
        self.images = images
        self.pre_pull: tuple[str, ...] = ()  # images mode: the images the runner unpacks first
        self.log_dir = self.state_dir / "logs"
        self.run_dir = self.state_dir / "run"
        self.kubeconfig = self.state_dir / "kubeconfig"

    # -- lifecycle ---------------------------------------------------------------------------

    def up(self) -> None:
        started = time.monotonic()
        runtime = imagesmode.runtime_image() if self.images else None
        build.ensure_all(COMPONENTS)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.runtime_image_file.unlink(missing_ok=True)
        if runtime is not None:  # read by `env`: the operators started beside the cluster
            self.runtime_image_file.write_text(runtime[1] + "\n")
            self.pre_pull = (OPERATOR.name, runtime[0])
        certs = pki.make_pki(self.state_dir / "pki", self.log_dir.parent / "pki.log")
        ports = self.ports()
        self.write_kubeconfig(certs, ports)
        for name in PROCESSES:
            self.ensure_process(name, certs, ports)
        self.apply_nodes(ports)
        print(
            f"==> dev cluster up in {time.monotonic() - started:.0f}s"
            f" (export KUBECONFIG={self.kubeconfig})",
            flush=True,
        )

    def down(self) -> None:
        """Stop what runs on top (operator, proxies the demo started), then the control plane."""
        extras = sorted(p.stem for p in self.run_dir.glob("*.pid") if p.stem not in PROCESSES)
        for name in [*extras, *reversed(PROCESSES)]:
            procs.stop(self.run_dir, name)
        shutil.rmtree(self.state_dir / "etcd-data", ignore_errors=True)
        shutil.rmtree(self.state_dir / "prometheus-data", ignore_errors=True)
        modelsources.stop(self.state_dir)
        (self.state_dir / "ports.json").unlink(missing_ok=True)
        self.runtime_image_file.unlink(missing_ok=True)

    def start_process(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        """Run a process beside the cluster (the operator, a service proxy) that `down` stops."""
        procs.stop(self.run_dir, name)
        return procs.start(name, argv, self.run_dir, self.log_dir, env).pid

    def stop_process(self, name: str) -> None:
        procs.stop(self.run_dir, name)

    def status(self) -> dict[str, bool]:
        return {name: procs.is_running(self.run_dir, name) for name in PROCESSES}

    def is_up(self) -> bool:
        return all(self.status().values())

    # -- processes ---------------------------------------------------------------------------

    def ports(self) -> Ports:
        """Ports of a running cluster are kept; a fresh one gets free ports (or the requested)."""
        saved = self.state_dir / "ports.json"
        if saved.exists() and any(self.status().values()):
            # A cluster started before the model servers existed has no ports for them yet.
            kept = json.loads(saved.read_text())
            s3, hf_hub = procs.free_ports(2, taken=set(kept.values()))
            ports = Ports(**{"s3": s3, "hf_hub": hf_hub, **kept})
            saved.write_text(json.dumps(asdict(ports)))
            return ports
        apiserver = self.requested_apiserver_port or procs.free_port()
        procs.require_port_free(apiserver, "kube-apiserver")
        etcd_client, etcd_peer, controller_manager, scheduler, prometheus, s3, hf_hub = (
            procs.free_ports(7, taken={apiserver})
        )
        ports = Ports(
            etcd_client=etcd_client,
            etcd_peer=etcd_peer,
            apiserver=apiserver,
            controller_manager=controller_manager,
            scheduler=scheduler,
            prometheus=prometheus,
            s3=s3,
            hf_hub=hf_hub,
        )
        saved.write_text(json.dumps(asdict(ports)))
        return ports

    def ensure_process(self, name: str, certs: pki.Pki, ports: Ports) -> None:
        if procs.is_running(self.run_dir, name):
            return
        print(f"==> starting {name}", flush=True)
        if name == modelsources.S3_PROCESS:  # these seed their data around the start
            modelsources.start_s3(self.state_dir, ports.s3)
            return
        if name == modelsources.HF_PROCESS:
            modelsources.start_hf_hub(self.state_dir, ports.hf_hub)
            return
        proc = procs.start(name, self.argv(name, certs, ports), self.run_dir, self.log_dir)
        self.wait_ready(proc, name, certs, ports)

    def argv(self, name: str, certs: pki.Pki, ports: Ports) -> list[str]:
        builders = {
            "etcd": self.etcd_argv,
            "kube-apiserver": self.apiserver_argv,
            "kube-controller-manager": self.controller_manager_argv,
            "kube-scheduler": self.scheduler_argv,
            "kwok": self.kwok_argv,
            "podrunner": self.podrunner_argv,
            "prometheus": self.prometheus_argv,
        }
        return builders[name](certs, ports)

    def etcd_argv(self, certs: pki.Pki, ports: Ports) -> list[str]:
        client = f"http://127.0.0.1:{ports.etcd_client}"
        peer = f"http://127.0.0.1:{ports.etcd_peer}"
        return [
            str(ETCD.path("etcd")),
            "--name=kvpilot-dev",
            f"--data-dir={self.state_dir / 'etcd-data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=kvpilot-dev={peer}",
            "--unsafe-no-fsync=true",
            "--quota-backend-bytes=4294967296",
        ]

    def apiserver_argv(self, certs: pki.Pki, ports: Ports) -> list[str]:
        return [
            str(KUBERNETES.path("kube-apiserver")),
            f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={ports.apiserver}",
            f"--cert-dir={self.state_dir / 'pki'}",
            f"--tls-cert-file={certs.crt('apiserver')}",
            f"--tls-private-key-file={certs.key('apiserver')}",
            f"--client-ca-file={certs.ca_crt}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={certs.sa_pub}",
            f"--service-account-signing-key-file={certs.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=RBAC",
            "--allow-privileged=true",
            # The advertise address is loopback, which the endpoint pass_scheduler refuses.
            "--endpoint-reconciler-type=none",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
        ]

    def controller_manager_argv(self, certs: pki.Pki, ports: Ports) -> list[str]:
        return [
            str(KUBERNETES.path("kube-controller-manager")),
            f"--kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports.controller_manager}",
            f"--cert-dir={self.state_dir / 'pki' / 'kcm'}",
            "--leader-elect=false",
            f"--service-account-private-key-file={certs.sa_key}",
            f"--root-ca-file={certs.ca_crt}",
            "--use-service-account-credentials=false",
            f"--cluster-signing-cert-file={certs.ca_crt}",
            f"--cluster-signing-key-file={certs.ca_key}",
            "--profiling=false",
            *CONTROLLER_CLIENT_LIMITS,
            # Default 5 each: with 200 Deployments created at once, the sync queues grow by the
            # time one sync waits on the API.
            "--concurrent-deployment-syncs=20",
            "--concurrent-replicaset-syncs=20",
        ]

    def scheduler_argv(self, certs: pki.Pki, ports: Ports) -> list[str]:
        return [
            str(KUBERNETES.path("kube-scheduler")),
            f"--kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports.scheduler}",
            f"--cert-dir={self.state_dir / 'pki' / 'scheduler'}",
            "--leader-elect=false",
            "--profiling=false",
            *CONTROLLER_CLIENT_LIMITS,
        ]

    def kwok_argv(self, certs: pki.Pki, ports: Ports) -> list[str]:
        return [
            str(KWOK.path("kwok")),
            f"--kubeconfig={self.kubeconfig}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={nodepools.KWOK_ANNOTATION}=fake",
            "--node-lease-duration-seconds=40",
            "--node-ip=127.0.0.1",
            "--cidr=127.255.0.1/16",
            f"--config={KWOK_STAGES}",
        ]

    def podrunner_argv(self, certs: pki.Pki, ports: Ports) -> list[str]:
        return [
            sys.executable,
            "-m",
            "hack.podrunner",
            f"--kubeconfig={self.kubeconfig}",
            f"--log-dir={self.log_dir / 'pods'}",
            # file:// models of this checkout (hack/closedloop.local_model_uri) load in images
            # mode as they do from the host's venv: the node has them at the same path
            *(["--images", f"--node-path={REPO_ROOT / 'models'}"] if self.images else []),
            *[f"--pre-pull={name}" for name in self.pre_pull],
        ]

    def prometheus_argv(self, certs: pki.Pki, ports: Ports) -> list[str]:
        config = prometheus.build_config(
            f"https://127.0.0.1:{ports.apiserver}",
            certs.ca_crt,
            certs.crt("admin"),
            certs.key("admin"),
        )
        config_file = self.state_dir / "prometheus.yaml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        return prometheus.argv(config_file, self.state_dir / "prometheus-data", ports.prometheus)

    def client_env(self) -> dict[str, str]:
        """HF_ENDPOINT and the AWS_* variables that reach the model servers (once up)."""
        saved = self.state_dir / "ports.json"
        if not saved.exists():
            return {}
        ports = json.loads(saved.read_text())
        if "s3" not in ports or "hf_hub" not in ports:
            return {}
        return modelsources.client_env(ports["hf_hub"], ports["s3"])

    @property
    def prometheus_url(self) -> str:
        ports = json.loads((self.state_dir / "ports.json").read_text())
        return f"http://127.0.0.1:{ports['prometheus']}"

    def wait_ready(
        self, proc: subprocess.Popen[bytes], name: str, certs: pki.Pki, ports: Ports
    ) -> None:
        tls = self.admin_ssl_context(certs)
        insecure = ssl._create_unverified_context()  # self-signed serving certs of kcm/scheduler
        checks: dict[str, tuple[str, ssl.SSLContext | None]] = {
            "etcd": (f"http://127.0.0.1:{ports.etcd_client}/health", None),
            "kube-apiserver": (f"https://127.0.0.1:{ports.apiserver}/readyz", tls),
            "kube-controller-manager": (
                f"https://127.0.0.1:{ports.controller_manager}/healthz",
                insecure,
            ),
            "kube-scheduler": (f"https://127.0.0.1:{ports.scheduler}/healthz", insecure),
            "prometheus": (f"http://127.0.0.1:{ports.prometheus}/-/ready", None),
        }
        if name in checks:
            url, context = checks[name]
            procs.wait_healthy(proc, url, self.log_dir / f"{name}.log", START_TIMEOUT_S, context)
        # kwok and the pod runner have no health endpoint: their health is the nodes turning
        # Ready (apply_nodes).
        elif procs.wait_for(lambda: proc.poll() is not None, 1.0):
            raise DevClusterError(f"{name} exited at start", self.log_dir / f"{name}.log")

    # -- kubeconfig and API ------------------------------------------------------------------

    def admin_ssl_context(self, certs: pki.Pki) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(certs.ca_crt))
        context.load_cert_chain(str(certs.crt("admin")), str(certs.key("admin")))
        return context

    def write_kubeconfig(self, certs: pki.Pki, ports: Ports) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "kvpilot-dev",
            "clusters": [
                {
                    "name": "kvpilot-dev",
                    "cluster": {
                        "server": f"https://127.0.0.1:{ports.apiserver}",
                        "certificate-authority": str(certs.ca_crt),
                    },
                }
            ],
            "users": [
                {
                    "name": "kvpilot-admin",
                    "user": {
                        "client-certificate": str(certs.crt("admin")),
                        "client-key": str(certs.key("admin")),
                    },
                }
            ],
            "contexts": [
                {
                    "name": "kvpilot-dev",
                    "context": {
                        "cluster": "kvpilot-dev",
                        "user": "kvpilot-admin",
                        "namespace": "default",
                    },
                }
            ],
        }
        self.kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))

    @property
    def runtime_image_file(self) -> Path:
        return self.state_dir / imagesmode.RUNTIME_IMAGE_FILE

    @property
    def env(self) -> dict[str, str]:
        """kubectl's and helm's environment, and an operator's: in images mode it names the
        runtime image the cluster runs (imagesmode.py)."""
        return {**kube_env(self.kubeconfig), **imagesmode.operator_env(self.state_dir)}

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(KUBERNETES.path("kubectl")), *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise DevClusterError(f"kubectl {' '.join(args)} failed: {done.stderr.strip()}")
        return done

    def api_client(self) -> Any:
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def apply_nodes(self, ports: Ports) -> None:
        """Create the fake GPU nodes (server-side apply, so re-running changes nothing)."""
        pools = nodepools.parse_pools(yaml.safe_load(NODEPOOLS.read_text()))
        nodes = nodepools.build_nodes(pools, nodepools.cluster_slot(ports.apiserver))
        existing = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        nodepools.keep_pod_cidrs(nodes, existing)
        doc = {"apiVersion": "v1", "kind": "List", "items": nodes}
        self.kubectl(
            "apply",
            "--server-side",
            "--field-manager=kvpilot-devcluster",
            "--force-conflicts",
            "-f",
            "-",
            input=json.dumps(doc),
        )
        names = [n["metadata"]["name"] for n in nodes]
        print(f"==> waiting for {len(names)} fake GPU nodes to be Ready", flush=True)
        if not procs.wait_for(lambda: self.ready_nodes() >= set(names), START_TIMEOUT_S, 0.5):
            missing = sorted(set(names) - self.ready_nodes())
            raise DevClusterError(
                f"nodes not Ready: {', '.join(missing)}", self.log_dir / "kwok.log"
            )

    def ready_nodes(self) -> set[str]:
        out = self.kubectl("get", "nodes", "-o", "json", check=False)
        if out.returncode != 0:
            return set()
        return {
            item["metadata"]["name"]
            for item in json.loads(out.stdout)["items"]
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in item.get("status", {}).get("conditions", [])
            )
        }
