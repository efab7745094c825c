"""The chart's gateway (kvpilot-gateway) rendered by the real helm: on by default with 2 replicas,
a Service on port 80, a PodDisruptionBudget, an optional HPA, probes, the Prometheus scrape
annotations the dev cluster's Prometheus selects, and least-privilege RBAC of its own."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from hack.devcluster import prometheus
from kvpilot.gateway import cli
from tests.support.helm_chart import component, container, find, render, require, rules

pytestmark = pytest.mark.slow  # runs helm (and kubeconform) on the chart

GATEWAY = "kvpilot-gateway"  # release `kvpilot`: the gateway's objects' name


@pytest.fixture(scope="module")
def helm_bin(helm_binary: Path) -> Path:
    return require(helm_binary)


@pytest.fixture(scope="module")
def defaults(helm_bin: Path) -> list[dict[str, Any]]:
    return render(helm_bin)


def gateway_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if component(o) == "gateway"]


def pod_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = find(objects, "Deployment", part="gateway")["spec"]["template"]["spec"]
    return spec


def parsed_args(objects: list[dict[str, Any]]) -> argparse.Namespace:
    """The container's args as the gateway CLI reads them (discovery's flags, plus these)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--discovery", choices=["static", "kubernetes"])
    parser.add_argument("--port", type=int)
    cli.add_discovery_arguments(parser)
    gateway = container(objects, "gateway")
    assert gateway["command"] == ["kvpilot-gateway"]
    args, unknown = parser.parse_known_args(gateway["args"])
    assert unknown == []
    return args


def test_the_gateway_is_on_by_default_with_two_replicas(defaults: list[dict[str, Any]]) -> None:
    kinds = sorted(o["kind"] for o in gateway_objects(defaults))
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
        "ServiceAccount",
    ]
    deployment = find(defaults, "Deployment", GATEWAY, part="gateway")
    assert deployment["spec"]["replicas"] == 2
    strategy = deployment["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxUnavailable": 0, "maxSurge": 1}
    args = parsed_args(defaults)
    assert (args.discovery, args.port, args.namespace) == ("kubernetes", 8080, [])
    assert pod_spec(defaults)["serviceAccountName"] == GATEWAY


def test_disabled_renders_nothing_of_the_gateway(helm_bin: Path) -> None:
    assert gateway_objects(render(helm_bin, {"gateway.enabled": "false"})) == []


def test_service_port_80_reaches_the_container_port_named_http(
    defaults: list[dict[str, Any]],
) -> None:
    service = find(defaults, "Service", GATEWAY, part="gateway")
    (port,) = service["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("http", 80, "http")
    (container_port,) = container(defaults, "gateway")["ports"]
    assert (container_port["name"], container_port["containerPort"]) == ("http", 8080)
    labels = pod_spec_labels(defaults)
    assert service["spec"]["selector"].items() <= labels.items()


def pod_spec_labels(objects: list[dict[str, Any]]) -> dict[str, str]:
    deployment = find(objects, "Deployment", part="gateway")
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def test_operator_selectors_never_pick_gateway_pods(defaults: list[dict[str, Any]]) -> None:
    """The operator's PDB and metrics Service select operator pods only, and the other way."""
    gateway_labels = pod_spec_labels(defaults)
    operator = find(defaults, "Deployment")
    operator_labels = operator["spec"]["template"]["metadata"]["labels"]
    assert not operator["spec"]["selector"]["matchLabels"].items() <= gateway_labels.items()
    gateway_selector = find(defaults, "Deployment", part="gateway")["spec"]["selector"]
    assert not gateway_selector["matchLabels"].items() <= operator_labels.items()


@pytest.mark.parametrize(
    ("values", "want"),
    [
        ({}, 1),
        ({"gateway.replicaCount": "1"}, None),
        ({"gateway.podDisruptionBudget.enabled": "false"}, None),
        ({"gateway.autoscaling.enabled": "true", "gateway.replicaCount": "1"}, 1),
    ],
)
def test_disruption_budget(helm_bin: Path, values: dict[str, str], want: int | None) -> None:
    objects = render(helm_bin, values)
    budgets = [o for o in gateway_objects(objects) if o["kind"] == "PodDisruptionBudget"]
    assert [b["spec"]["maxUnavailable"] for b in budgets] == ([want] if want else [])
    for budget in budgets:
        assert budget["spec"]["selector"]["matchLabels"].items() <= pod_spec_labels(objects).items()


def test_hpa_ready_and_optional(helm_bin: Path, defaults: list[dict[str, Any]]) -> None:
    resources = container(defaults, "gateway")["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"]  # HPA needs requests
    assert not [o for o in gateway_objects(defaults) if o["kind"] == "HorizontalPodAutoscaler"]
    values = {"gateway.autoscaling.enabled": "true", "gateway.autoscaling.maxReplicas": "6"}
    objects = render(helm_bin, values)
    hpa = find(objects, "HorizontalPodAutoscaler", GATEWAY, part="gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": GATEWAY,
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    # the HPA owns the replica count: the Deployment leaves it out, so upgrades do not reset it
    assert "replicas" not in find(objects, "Deployment", part="gateway")["spec"]


def test_readiness_asks_ready_and_liveness_asks_health_on_the_http_port(
    defaults: list[dict[str, Any]],
) -> None:
    """/ready fails while the budget store is down (out of the Service); /health only when the
    process does not answer (a restart would not bring Redis back). Issue 40 item 8."""
    gateway = container(defaults, "gateway")
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_pods_carry_what_the_dev_clusters_prometheus_scrapes(
    defaults: list[dict[str, Any]], tmp_path: Path
) -> None:
    config = prometheus.build_config("https://127.0.0.1:6443", tmp_path, tmp_path, tmp_path)
    (job,) = [j for j in config["scrape_configs"] if "kubernetes_sd_configs" in j]
    selected = {
        source
        for rule in job["relabel_configs"]
        for source in rule.get("source_labels", [])
        if source.startswith("__meta_kubernetes_pod_annotation_")
    }
    deployment = find(defaults, "Deployment", part="gateway")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    as_labels = {
        "__meta_kubernetes_pod_annotation_" + k.replace(".", "_").replace("/", "_"): v
        for k, v in annotations.items()
    }
    assert selected <= as_labels.keys()
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8080"
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_gateway_pod_is_locked_down(defaults: list[dict[str, Any]]) -> None:
    pod = pod_spec(defaults)
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["limits"]["memory"]


@pytest.mark.parametrize(
    ("values", "want"),
    [
        ({}, "ghcr.io/kvpilot/operator:0.1.0"),
        ({"image.tag": "0.2.0"}, "ghcr.io/kvpilot/operator:0.2.0"),
        ({"gateway.image.repository": "r.local/gw", "gateway.image.tag": "v1"}, "r.local/gw:v1"),
    ],
)
def test_the_image_is_the_operators_unless_named(
    helm_bin: Path, values: dict[str, str], want: str
) -> None:
    assert container(render(helm_bin, values), "gateway")["image"] == want


def granted(objects: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    found: dict[tuple[str, str], set[str]] = {}
    for rule in rules(objects, "gateway"):
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                found.setdefault((group, resource), set()).update(rule["verbs"])
    return found


def test_rules_grant_what_discovery_and_the_waker_use_and_no_more(
    helm_bin: Path, defaults: list[dict[str, Any]]
) -> None:
    assert granted(defaults) == {
        ("kvpilot.dev", "modeldeployments"): {"list", "watch", "patch"},
        ("", "pods"): {"list", "watch"},
        ("", "secrets"): {"get"},  # provider API keys, by name
    }
    for rule in rules(defaults, "gateway"):
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
    off = render(helm_bin, {"gateway.rbac.readProviderSecrets": "false"})
    assert ("", "secrets") not in granted(off)


@pytest.mark.parametrize(
    ("values", "want"),
    [
        ({"gateway.watchNamespaces": "{team-a,team-b}"}, ["team-a", "team-b"]),
        ({"watchNamespace": "ml"}, ["ml"]),  # follows the operator's namespace
    ],
)
def test_namespaced_gateway_gets_roles_in_its_namespaces(
    helm_bin: Path, values: dict[str, str], want: list[str]
) -> None:
    objects = render(helm_bin, values)
    gateway = gateway_objects(objects)
    assert not [o for o in gateway if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    roles = sorted(o["metadata"]["namespace"] for o in gateway if o["kind"] == "Role")
    bindings = sorted(o["metadata"]["namespace"] for o in gateway if o["kind"] == "RoleBinding")
    assert roles == bindings == want
    assert parsed_args(objects).namespace == want
    assert granted(objects)[("", "pods")] == {"list", "watch"}


def test_values_schema_rejects_a_misspelt_gateway_key(helm_bin: Path) -> None:
    from tests.support.helm_chart import CHART, helm

    for key, value in (("gateway.replicas", "3"), ("gateway.autoscaling.maxReplica", "4")):
        done = helm(helm_bin, "template", str(CHART), "--set", f"{key}={value}", check=False)
        assert done.returncode != 0, key
        assert "values don't meet the specifications of the schema" in done.stderr


def test_networkpolicy_lets_clients_in_on_the_gateway_port(helm_bin: Path) -> None:
    objects = render(helm_bin, {"networkPolicy.enabled": "true"})
    policy = find(objects, "NetworkPolicy", GATEWAY, part="gateway")
    (ingress,) = policy["spec"]["ingress"]
    assert ingress["ports"] == [{"port": 8080, "protocol": "TCP"}]
    egress_ports = {p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert {53, 443, 6443, 8000} <= egress_ports
    assert json.dumps(policy["spec"]["podSelector"]["matchLabels"]) == json.dumps(
        find(objects, "Deployment", part="gateway")["spec"]["selector"]["matchLabels"]
    )


def test_extra_args_and_env_reach_the_container(helm_bin: Path) -> None:
    flags = ["--strategy=least-load", "--fallback-after=20"]
    env = [{"name": "HTTPS_PROXY", "value": "http://proxy.local:3128"}]
    extra = ["--set-json", f"gateway.extraArgs={json.dumps(flags)}"]
    extra += ["--set-json", f"gateway.env={json.dumps(env)}"]
    gateway = container(render(helm_bin, extra=extra), "gateway")
    assert gateway["args"][-2:] == flags
    assert gateway["env"] == env
    assert "env" not in container(render(helm_bin), "gateway")
