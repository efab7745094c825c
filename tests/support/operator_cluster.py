"""Helpers for tests that run the real operator (`kvpilot-operator run`, a subprocess) against
the local control plane and watch the result with real `kubectl`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / ".venv" / "bin" / "kvpilot-operator"
T = TypeVar("T")


class Operator:
    """`kvpilot-operator run ARGS` against `cluster`, logging to `log`; `env`: variables set over
    the cluster's environment (the operator's KVPILOT_* settings)."""

    def __init__(
        self, cluster: Any, log: Path, *args: str, env: dict[str, str] | None = None
    ) -> None:
        self.cluster, self.log, self.args = cluster, log, args
        self.env = {**cluster.env, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(OPERATOR), "run", *self.args],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Send `sig`; SIGKILL if the operator has not exited 20 s later. Its exit code, or
        None when it had to be killed (or was not running)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            return None

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])


def wait_for(
    predicate: Callable[[], T], what: str, op: Operator | None = None, timeout: float = 90
) -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except Exception as error:  # e.g. kubectl get of an object not there yet: keep polling
            last = error
        else:
            if last:
                return last
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {what}; last: {last!r}\n{op.tail() if op else ''}")


def get(cluster: Any, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def apply_doc(cluster: Any, namespace: str, doc: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc))


def events(cluster: Any, namespace: str, name: str, reason: str) -> list[str]:
    """The messages of the Events with `reason` about the object `name`."""
    selector = f"involvedObject.name={name}"
    found = get(cluster, "events", "-n", namespace, "--field-selector", selector)["items"]
    return [e["message"] for e in found if e.get("reason") == reason]


def model_deployment(name: str, uri: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"uri": uri}, **spec},
    }


def condition(md: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in md.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def is_ready(cluster: Any, namespace: str, name: str) -> bool:
    md = get(cluster, "modeldeployment", name, "-n", namespace)
    return condition(md, "Ready").get("status") == "True"


def ready_check(cluster: Any, namespace: str, name: str) -> Callable[[], bool]:
    """A wait_for predicate whose last failure shows the Ready condition and the pods' phases."""

    def check() -> bool:
        md = get(cluster, "modeldeployment", name, "-n", namespace)
        ready = condition(md, "Ready")
        if ready.get("status") == "True":
            return True
        phases = [
            (p["metadata"]["name"], p["status"].get("phase"))
            for p in pods(cluster, namespace, name)
        ]
        raise AssertionError(f"Ready={ready}; pods {phases}")

    return check


def pods(cluster: Any, namespace: str, model: str) -> list[dict[str, Any]]:
    return get(cluster, "pods", "-n", namespace, "-l", f"kvpilot.dev/model={model}")["items"]


TINY_FACTS = {"parameters": 3819776, "layers": 4, "kvHeads": 2, "headDim": 32, "vocabSize": 4096}


def tiny_llama_from(
    uri: str, cluster: Any, secret: str, facts: dict[str, int] | None = None
) -> dict[str, Any]:
    """tiny-llama on the `local` pool (real processes) from the dev cluster's model servers;
    the endpoints come through spec.runtime.env, the credentials through the Secret."""
    endpoints = {
        k: v
        for k, v in model_server_env(cluster).items()
        if k.endswith(("ENDPOINT", "URL", "REGION"))
    }
    md = model_deployment(
        "tiny",
        uri,
        serving={"maxContextLength": 256, "targetConcurrency": 2},
        placement={"nodeTypes": ["local"]},
        autoscaling={"mode": "off", "replicas": 1},
        runtime={"env": [{"name": k, "value": v} for k, v in endpoints.items()]},
    )
    # Without facts the operator reads config.json and the safetensors headers itself.
    md["spec"]["model"].update(servedName="tiny", secretRef={"name": secret}, **(facts or {}))
    return md


def model_server_env(cluster: Any) -> dict[str, str]:
    env = cluster.client_env() if hasattr(cluster, "client_env") else dict(os.environ)
    if not env.get("HF_ENDPOINT") or not env.get("AWS_ENDPOINT_URL"):
        pytest.skip("the cluster runs no model servers (hack/devcluster up starts them)")
    return env


def apply_secret(cluster: Any, namespace: str, name: str, data: dict[str, str]) -> None:
    literals = [f"--from-literal={k}={v}" for k, v in data.items()]
    made = cluster.kubectl(
        "create",
        "secret",
        "generic",
        name,
        "-n",
        namespace,
        *literals,
        "--dry-run=client",
        "-o",
        "json",
    )
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=made.stdout)


def pod_url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:8000"


def complete(pod: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A completion from the pod's runtime (4 tokens unless `fields` say otherwise)."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, **fields}
    return dict(httpx.post(f"{pod_url(pod)}/v1/completions", json=body, timeout=60).json())


def pod_metrics(pod: dict[str, Any]) -> dict[str, float]:
    """The pod's runtime /metrics, sample name -> value."""
    return {name: value for name, _, value in pod_samples(pod)}


def pod_samples(pod: dict[str, Any]) -> list[tuple[str, dict[str, str], float]]:
    """The pod's runtime /metrics, (sample name, labels, value) each."""
    text = httpx.get(f"{pod_url(pod)}/metrics", timeout=10).text
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def reconciles(metrics_port: int) -> float:
    """Successful passes an operator instance reports on its own /metrics (`--metrics-port`)."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvpilot_operator_reconcile_total"
        and sample.labels["outcome"] == "success"
    )


def fill_pods(cluster: Any, namespace: str, claim: str) -> list[dict[str, Any]]:
    """The pods of the Job that fills the model cache `claim`."""
    selector = f"kvpilot.dev/model-cache={claim}"
    return get(cluster, "pods", "-n", namespace, "-l", selector)["items"]
