"""kube-score (built from Go modules) on the chart's operator and gateway Deployments and on the
runtime Deployment the operator builds: every finding is fixed or explained in
kube-score-allowlist.yaml."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.operator.config import DeclaredNodeType, OperatorConfig
from kvpilot.operator.planning import inventory
from kvpilot.operator.reconcile import desired_state
from tests.support.helm_chart import ROOT, component, kube_score_binary, render, require

pytestmark = pytest.mark.slow  # runs helm (and kubeconform) on the chart

ALLOWLIST = Path(__file__).with_name("kube-score-allowlist.yaml")
Finding = tuple[str, str, str]  # (workload, check id, summary)


def kube_score(objects: list[dict[str, Any]], workload: str, tmp_path: Path) -> set[Finding]:
    manifest = tmp_path / f"{workload}.yaml"
    manifest.write_text(yaml.safe_dump_all(objects))
    binary = require(kube_score_binary())
    argv = [str(binary), "score", "--output-format", "json", str(manifest)]
    # kube-score exits 1 when it finds something; the JSON is the answer either way
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode in (0, 1), done.stderr
    findings = set()
    for obj in json.loads(done.stdout):
        for check in obj["checks"]:
            if check["skipped"] or check["grade"] >= 10:
                continue
            for comment in check["comments"] or [{"summary": check["check"]["name"]}]:
                findings.add((workload, check["check"]["id"], comment["summary"]))
    return findings


def allowed() -> dict[Finding, str]:
    entries = yaml.safe_load(ALLOWLIST.read_text())
    return {(e["workload"], e["check"], e["summary"]): e["reason"] for e in entries}


def runtime_objects() -> list[dict[str, Any]]:
    """What the operator applies for an example ModelDeployment (its real reconcile code)."""
    l4 = DeclaredNodeType(
        name="l4-24gb",
        node_selector={"kvpilot.dev/pool": "l4"},
        gpu_memory_mib=23034,
        gpus_per_node=1,
        price_per_hour=0.98,
    )
    config = OperatorConfig(node_types=(l4,))
    md = yaml.safe_load((ROOT / "examples" / "qwen2.5-7b-instruct.yaml").read_text())
    md["metadata"].update(namespace="ml", uid="0000-uid", generation=1)
    node_types = tuple(inventory.discover([], [], config.node_types))
    desired = desired_state.desire(md, config, desired_state.Observed(node_types=node_types))
    assert desired.error is None, desired.error
    return desired.children


@pytest.fixture(scope="module")
def findings(helm_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> set[Finding]:
    tmp = tmp_path_factory.mktemp("kube-score")
    # the hardened, highly available configuration: a PDB exists only with 2+ replicas
    hardened = {"networkPolicy.enabled": "true", "replicaCount": "2"}
    chart = render(require(helm_binary), hardened)
    gateway = [o for o in chart if component(o) == "gateway"]
    operator = [o for o in chart if component(o) != "gateway"]
    return (
        kube_score(operator, "operator", tmp)
        | kube_score(gateway, "gateway", tmp)
        | kube_score(runtime_objects(), "runtime", tmp)
    )


def test_every_finding_is_fixed_or_explained(findings: set[Finding]) -> None:
    unexplained = sorted(findings - set(allowed()))
    assert not unexplained, "fix these or explain them in kube-score-allowlist.yaml:\n" + "\n".join(
        map(str, unexplained)
    )


def test_every_explanation_still_matches_a_finding(findings: set[Finding]) -> None:
    stale = sorted(set(allowed()) - findings)
    assert not stale, "fixed: delete these from kube-score-allowlist.yaml:\n" + "\n".join(
        map(str, stale)
    )


def test_explanations_are_real_sentences() -> None:
    for finding, reason in allowed().items():
        assert len(reason.split()) >= 8, finding


def test_the_linter_finds_a_planted_problem(tmp_path: Path) -> None:
    """kube-score really inspects the objects: a root, writable, privileged pod is reported."""
    bad = runtime_objects()[0]
    pod = bad["spec"]["template"]["spec"]
    pod["securityContext"] = {}
    pod["containers"][0]["securityContext"] = {"privileged": True}
    got = {check for _, check, _ in kube_score([bad], "runtime", tmp_path)}
    assert {
        "container-security-context-privileged",
        "container-security-context-readonlyrootfilesystem",
    } <= got
