"""The real operator (`kvpilot-operator run`) with nothing but the chart's ServiceAccount identity
(a token from `kubectl create token`) runs the operator-core scenario: it plans and rolls out the
examples, posts Events, writes status, and never needs a right the chart does not grant. Git stays
the source of truth: after reconcile, `kubectl diff` of the applied ModelDeployment is empty."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.helm_chart import ROOT, container, render, require
from tests.support.helm_release import Release
from tests.support.kube import fresh_namespace, get_json, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

OPERATOR = ROOT / ".venv" / "bin" / "kvpilot-operator"
EXAMPLES = {
    "qwen2-5-7b-instruct": ROOT / "examples" / "qwen2.5-7b-instruct.yaml",
    "llama-3-1-70b-instruct": ROOT / "examples" / "llama-3.1-70b-instruct.yaml",
}
# A refusal in the operator's log: the status code (not the milliseconds of a log timestamp such
# as "15:02:17,403") or the reason.
FORBIDDEN = re.compile(r"(?<![,.\d])403(?!\d)|Forbidden|forbidden|Not enough permissions")


class OperatorProcess:
    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture
def release(cluster: Any, helm_binary: Path) -> Iterator[Release]:
    rel = Release.new(cluster, require(helm_binary), "kvo")
    rel.install({"replicaCount": "0"})  # the operator runs here, as the chart's identity
    yield rel
    rel.uninstall()
    cluster.kubectl("delete", "namespace", rel.namespace, "--wait=false", check=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def chart_args(helm_binary: Path, config: Path, kubeconfig: Path) -> tuple[list[str], int]:
    """The chart's container args, with this machine's paths and free ports; the metrics port."""
    metrics_port = free_port()
    local = {
        "--config": f"--config={config}",
        "--metrics-port": f"--metrics-port={metrics_port}",
    }
    args = [local.get(a.split("=", 1)[0], a) for a in container(render(helm_binary))["args"]]
    return [*args, f"--kubeconfig={kubeconfig}"], metrics_port


# Two instances, as a chart with replicaCount 2 runs them: the first takes the leader-election
# Lease and acts, the second waits as a standby.
INSTANCES = 2


@pytest.fixture
def operators(
    cluster: Any, release: Release, helm_binary: Path, tmp_path: Path
) -> Iterator[list[tuple[OperatorProcess, int]]]:
    kubeconfig = release.service_account_kubeconfig(tmp_path / "sa-kubeconfig")
    config = tmp_path / "config.yaml"
    config.write_text(release.config_yaml())  # the chart's ConfigMap, as the pod would mount it
    # POD_NAMESPACE: what the chart's downward API gives the pod (the autoscaler Lease's home)
    env = {**cluster.env, "KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": release.namespace}
    running = []
    for i in range(INSTANCES):
        args, metrics_port = chart_args(helm_binary, config, kubeconfig)
        argv = [str(OPERATOR), *args]
        proc = OperatorProcess(argv, env, tmp_path / f"operator-{i}.log")
        running.append((proc, metrics_port))
        # one at a time, so the first is the one that acts: ready means it knows its role
        wait_until(
            lambda port=metrics_port: is_ready(port),  # type: ignore[misc]
            timeout_s=60,
            what=f"instance {i} ready",
        )
    yield running
    for proc, _ in running:
        proc.stop()


@pytest.fixture
def namespace(cluster: Any) -> Iterator[str]:
    with fresh_namespace(cluster, "lp") as name:
        yield name


def is_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return bool(response.status == 200)
    except OSError:  # not listening yet, or 503 (HTTPError is an OSError)
        return False


def condition(md: dict[str, Any], kind: str) -> dict[str, Any]:
    conditions = (md.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def test_operator_as_its_service_account_reconciles_the_examples(
    cluster: Any, release: Release, operators: list[tuple[OperatorProcess, int]], namespace: str
) -> None:
    require(OPERATOR)
    for path in EXAMPLES.values():
        cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", str(path))

    def ready(name: str) -> dict[str, Any] | None:
        for proc, _ in operators:
            if proc.proc.poll() is not None:
                raise AssertionError(f"operator exited:\n{proc.text()[-3000:]}")
        md = get_json(cluster, "modeldeployment", name, "-n", namespace)
        return md if condition(md, "Ready").get("status") == "True" else None

    for name in EXAMPLES:
        try:
            md = wait_until(lambda n=name: ready(n), timeout_s=180, what=f"{name} Ready")  # type: ignore[misc]
        except AssertionError as error:
            logs = "\n".join(proc.text()[-2000:] for proc, _ in operators)
            state = cluster.kubectl("get", "modeldeployment", name, "-n", namespace, "-o", "yaml")
            raise AssertionError(f"{error}\n{state.stdout}\n{logs}") from None
        assert condition(md, "Planned")["status"] == "True"
        assert md["status"]["observedGeneration"] == md["metadata"]["generation"]
        service = get_json(cluster, "service", name, "-n", namespace)
        assert service["metadata"]["ownerReferences"][0]["name"] == name

    llama = get_json(cluster, "modeldeployment", "llama-3-1-70b-instruct", "-n", namespace)
    first = llama["status"]["plan"][0]
    assert (first["nodeType"], first["quantization"], first["tensorParallel"]) == (
        "h100-80gb",
        "bf16",
        4,
    )
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", "reason=Planned")
    assert {e["involvedObject"]["name"] for e in events["items"]} >= set(EXAMPLES)

    # Git stays the source of truth: the operator wrote status, not spec.
    for path in EXAMPLES.values():
        diff = cluster.kubectl(
            "diff", "--server-side", "-n", namespace, "-f", str(path), check=False
        )
        assert diff.returncode == 0 and diff.stdout == "", diff.stdout + diff.stderr

    # The first instance holds the Lease: the Role lets it take it by name.
    first = f"{socket.gethostname()}_{operators[0][0].proc.pid}"
    lease = wait_until(
        lambda: (
            cluster.kubectl(
                "get",
                "lease",
                "kvpilot-operator",
                "-n",
                release.namespace,
                "-o",
                "json",
                check=False,
            ).stdout
        ),
        timeout_s=60,
        what="the leader-election Lease",
    )
    assert json.loads(lease)["spec"]["holderIdentity"] == first

    for proc, _ in operators:
        log = proc.text()
        refusals = [m.group(0) for m in FORBIDDEN.finditer(log)]
        assert not refusals, log[-3000:]
    # Only the Lease holder acted; the standby's probes answer too.
    assert [operator_reconciles(port) > 0 for _, port in operators] == [True, False]


def operator_reconciles(port: int) -> float:
    """Successful reconciles an instance reports on its own /metrics (and /healthz answers, and
    /readyz: the chart's rights let it learn the Lease's holder, active instance or standby)."""
    for probe in ("/healthz", "/readyz"):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{probe}", timeout=5) as response:
            assert response.status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvpilot_operator_reconcile_total" and s.labels["outcome"] == "success"
    )
