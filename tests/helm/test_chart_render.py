"""The chart rendered by the real helm (no cluster needed): lint, Kubernetes 1.37 schemas, strict
values, least-privilege rules, and the contracts with the operator's config and CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from hack import release
from hack.podrunner import images as podrunner_images
from hack.podrunner.images import ImageRef
from kvpilot.operator import cli, config, lease, observability
from kvpilot.operator.autoscaling import metrics_reader as operator_metrics
from kvpilot.runtime.engine.stats import EngineStats
from kvpilot.runtime.server import metrics as runtime_metrics
from tests.support.helm_chart import (
    CHART,
    ROOT,
    component,
    config_yaml,
    container,
    find,
    helm,
    kinds,
    render,
    require,
    rules,
    set_args,
)

pytestmark = pytest.mark.slow  # runs helm (and kubeconform) on the chart

ALL_ON = {
    "metrics.serviceMonitor.enabled": "true",
    "dashboard.enabled": "true",
    "podMonitors.enabled": "true",
    "networkPolicy.enabled": "true",
}
NAMESPACED = {"watchNamespace": "ml-team"}
RELEASE_NAMESPACE = "kvpilot-system"  # render()'s default
CUSTOM_RESOURCES = {"ServiceMonitor"}  # Prometheus Operator's, no schema in kubernetes-validate


@pytest.fixture(scope="module")
def helm_bin(helm_binary: Path) -> Path:
    return require(helm_binary)


@pytest.mark.parametrize("values", [{}, ALL_ON, NAMESPACED], ids=["defaults", "all-on", "ns"])
def test_helm_lint_is_clean(helm_bin: Path, values: dict[str, str]) -> None:
    done = helm(helm_bin, "lint", "--strict", str(CHART), *set_args(values), check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("values", [{}, ALL_ON, NAMESPACED], ids=["defaults", "all-on", "ns"])
def test_rendered_objects_validate_against_kubernetes_1_37(
    helm_bin: Path, values: dict[str, str]
) -> None:
    objects = render(helm_bin, values, extra=["--include-crds"])
    for obj in objects:
        if obj["kind"] in CUSTOM_RESOURCES:
            continue
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
    assert {"Deployment", "ServiceAccount", "ClusterRole", "ConfigMap"} <= set(kinds(objects))
    crds = {o["metadata"]["name"] for o in objects if o["kind"] == "CustomResourceDefinition"}
    assert crds == {"modeldeployments.kvpilot.dev"}  # leader election needs no CRD: a Lease


def test_a_schema_violation_is_caught_by_the_validator(helm_bin: Path) -> None:
    deployment = find(render(helm_bin), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsNonRot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.37.0", strict=True)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("replicaCont", "3"),  # misspelt top-level key
        ("config.prometeusUrl", "http://p:9090"),  # misspelt nested key
        ("metrics.serviceMonitor.enable", "true"),
        ("config.autoscalerIntervalSeconds", "-5"),  # out of range
        ("image.pullPolicy", "Sometimes"),
        ("config.nodeTypes[0].name", "a10g"),  # a node type without its required fields
    ],
)
def test_values_schema_rejects_bad_values(helm_bin: Path, key: str, value: str) -> None:
    for command in ("template", "lint"):
        argv = [command, str(CHART), "--set", f"{key}={value}"]
        done = helm(helm_bin, *argv, check=False)
        assert done.returncode != 0, f"helm {command} accepted {key}={value}"
        assert "values don't meet the specifications of the schema" in done.stderr + done.stdout


def test_values_schema_has_no_open_objects_by_accident() -> None:
    """Every object in the schema closes its keys, except the free-form maps listed here."""
    free_form = {
        "global",
        "tolerations.items",
        "affinity",
        "gateway.tolerations.items",
        "gateway.affinity",
        "gateway.env.items.valueFrom",
    }
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: dict[str, Any], where: str) -> list[str]:
        found = []
        if node.get("type") == "object" and "additionalProperties" not in node:
            found.append(where)
        for key, child in node.get("properties", {}).items():
            found += walk(child, f"{where}.{key}".lstrip("."))
        if isinstance(node.get("items"), dict):
            found += walk(node["items"], f"{where}.items")
        return found

    assert set(walk(schema, "")) == free_form


def test_no_rule_uses_a_wildcard(helm_bin: Path) -> None:
    for values in ({}, ALL_ON, NAMESPACED):
        objects = render(helm_bin, values)
        for rule in rules(objects) + rules(objects, "gateway"):
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(field, []), rule


def granted(objects: list[dict[str, Any]], group: str, resource: str) -> set[str]:
    return {
        verb
        for rule in rules(objects)
        if group in rule["apiGroups"] and resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_rules_grant_what_the_operator_uses_and_no_more(helm_bin: Path) -> None:
    objects = render(helm_bin)
    want = {
        ("", "nodes"): {"get", "list", "watch"},
        ("", "pods"): {"get", "list", "watch"},
        ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
        ("", "services"): {"get", "list", "watch", "create", "patch", "delete"},
        # the model cache: created once, patched only to add an owner; kopf watches the Jobs
        ("", "persistentvolumeclaims"): {"create", "patch"},
        # eval Jobs (quality/io.py) are deleted once read, as well
        ("batch", "jobs"): {"get", "list", "watch", "create", "patch", "delete"},
        # the eval set read by name; the measurement cache created and merged into
        ("", "configmaps"): {"get", "create", "patch"},
        ("", "events"): {"create"},
        ("events.k8s.io", "events"): {"create"},
        ("kvpilot.dev", "modeldeployments"): {"get", "list", "watch"},
        ("kvpilot.dev", "modeldeployments/status"): {"get", "patch"},
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
        ("coordination.k8s.io", "leases"): {"get", "create", "update"},
        # InferencePools (spec.routing.endpointPickerRef): applied, read, deleted by name
        ("inference.networking.k8s.io", "inferencepools"): {"get", "create", "patch", "delete"},
    }
    got = {
        (group, resource): granted(objects, group, resource)
        for rule in rules(objects)
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert got == want
    assert not granted(objects, "", "secrets")
    # Opt-in: by name, the Secret spec.model.secretRef names (planning/model_facts.py); never
    # list/watch.
    opted_in = render(helm_bin, {"rbac.readModelSecrets": "true"})
    assert granted(opted_in, "", "secrets") == {"get"}
    assert not granted(objects, "kvpilot.dev", "modeldeployments") & {"update", "create"}


def test_the_autoscaler_lease_is_granted_by_name_in_the_release_namespace(
    helm_bin: Path,
) -> None:
    for values in ({}, NAMESPACED):
        objects = render(helm_bin, values)
        lease_rules = [r for r in rules(objects) if "leases" in r["resources"]]
        assert {tuple(r["verbs"]): r.get("resourceNames") for r in lease_rules} == {
            ("create",): None,  # create cannot be limited by name
            ("get", "update"): [lease.LEASE_NAME],
        }
        (role,) = [
            o
            for o in objects
            if o["kind"] == "Role" and any("leases" in r["resources"] for r in o["rules"])
        ]
        assert role["metadata"]["namespace"] == RELEASE_NAMESPACE
        env = {
            e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container(objects)["env"]
        }
        assert env == {"POD_NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"}


def test_podmonitor_rights_only_when_enabled(helm_bin: Path) -> None:
    assert not granted(render(helm_bin), "monitoring.coreos.com", "podmonitors")
    on = render(helm_bin, {"podMonitors.enabled": "true"})
    assert granted(on, "monitoring.coreos.com", "podmonitors") == {
        "get",
        "list",
        "watch",
        "create",
        "patch",
        "delete",
    }


def test_namespaced_install_keeps_namespaced_rights_in_a_role(helm_bin: Path) -> None:
    objects = render(helm_bin, NAMESPACED)
    role, cluster_role = find(objects, "Role", "kvpilot"), find(objects, "ClusterRole")
    assert role["metadata"]["namespace"] == "ml-team"
    assert find(objects, "RoleBinding", "kvpilot")["metadata"]["namespace"] == "ml-team"
    cluster_resources = {r for rule in cluster_role["rules"] for r in rule["resources"]}
    assert cluster_resources == {"nodes", "customresourcedefinitions"}
    role_resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert not {"kopfpeerings", "clusterkopfpeerings"} & role_resources  # the Lease decides
    assert "--namespace=ml-team" in container(objects)["args"]


def test_operator_pod_is_locked_down(helm_bin: Path) -> None:
    pod = find(render(helm_bin), "Deployment")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # Both on the operator's own server, which a standby waiting for the Lease runs too.
    ports = {port["name"]: port["containerPort"] for port in c["ports"]}
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert c[probe]["httpGet"] == {"path": path, "port": ports["metrics"]}
    assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]


def test_replicas_and_disruption_budget(helm_bin: Path) -> None:
    objects = render(helm_bin, {"replicaCount": "3"})
    assert find(objects, "Deployment")["spec"]["replicas"] == 3
    assert find(objects, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    one = render(helm_bin, {"replicaCount": "1"})
    assert not [o for o in one if o["kind"] == "PodDisruptionBudget" and component(o) == "operator"]


def test_configmap_is_a_config_the_operator_accepts(helm_bin: Path) -> None:
    values = {
        "config.prometheusUrl": "http://prometheus.monitoring:9090",
        "config.autoscalerIntervalSeconds": "30",
        "config.runtimeImage": "registry.local/runtime:1.2.3",
    }
    declared = {
        "name": "a10g-24gb",
        "nodeSelector": {"node.kubernetes.io/instance-type": "g5.xlarge"},
        "gpuMemoryMiB": 23028,
        "gpusPerNode": 1,
        "pricePerHour": 1.006,
    }
    node_types = ["--set-json", f"config.nodeTypes={json.dumps([declared])}"]
    parsed = config.from_mapping(config_yaml(render(helm_bin, values, extra=node_types)), env={})
    assert parsed.prometheus_url == "http://prometheus.monitoring:9090"
    assert parsed.autoscaler_interval_seconds == 30
    assert parsed.runtime_image == "registry.local/runtime:1.2.3"
    (node_type,) = parsed.node_types
    assert node_type.name == "a10g-24gb" and node_type.gpu_memory_mib == 23028
    assert node_type.node_selector == {"node.kubernetes.io/instance-type": "g5.xlarge"}
    assert node_type.price_per_hour == pytest.approx(1.006)
    defaults = config.from_mapping(config_yaml(render(helm_bin)), env={})
    assert defaults.prometheus_url == "" and defaults.node_types == ()


def test_a_cpu_only_cluster_names_the_cpu_runtime_image(helm_bin: Path) -> None:
    """`config.runtimeVariant=cpu`: the operator's parser reads the CPU variant's released
    reference (what hack/release.py pushes kvpilot-runtime-cpu as, and what images mode runs
    from its layout); with runtimeImage set too, helm refuses rather than dropping one."""
    cpu = config.from_mapping(config_yaml(render(helm_bin, {"config.runtimeVariant": "cpu"})), {})
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert cpu.runtime_image == f"ghcr.io/kvpilot/runtime:{app_version}-cpu"
    pushed = {layout.name: ref for layout, ref in release.image_references(app_version)}
    assert cpu.runtime_image == pushed["kvpilot-runtime-cpu"]
    assert podrunner_images.parse_reference(cpu.runtime_image, "") == ImageRef(
        "kvpilot-runtime-cpu", app_version, None
    )
    default = config.from_mapping(config_yaml(render(helm_bin)), {})
    assert default.runtime_image == pushed["kvpilot-runtime"]
    both = {"config.runtimeVariant": "cpu", "config.runtimeImage": "registry.local/runtime:1"}
    refused = helm(helm_bin, "template", "kvpilot", str(CHART), *set_args(both), check=False)
    assert refused.returncode != 0 and "name the variant's image there" in refused.stderr
    unknown = {"config.runtimeVariant": "rocm"}
    refused = helm(helm_bin, "template", "kvpilot", str(CHART), *set_args(unknown), check=False)
    assert refused.returncode != 0 and "runtimeVariant" in refused.stderr


def test_config_change_rolls_the_pods(helm_bin: Path) -> None:
    def config_hash(values: dict[str, str]) -> str:
        template = find(render(helm_bin, values), "Deployment")["spec"]["template"]
        return str(template["metadata"]["annotations"]["kvpilot.dev/config-hash"])

    assert config_hash({}) != config_hash({"config.autoscalerIntervalSeconds": "60"})
    assert config_hash({}) == config_hash({"replicaCount": "3"})


def test_container_args_are_what_the_operator_cli_parses(helm_bin: Path) -> None:
    args = container(render(helm_bin, {"logLevel": "debug", **NAMESPACED}))["args"]
    parsed, unknown = cli.parser().parse_known_args(args)
    assert unknown == []
    assert parsed.command == "run"
    assert str(parsed.config) == "/etc/kvpilot/config.yaml"
    assert parsed.namespace == "ml-team" and parsed.verbose is True
    assert parsed.liveness == ""  # kopf's endpoint starts only in the Lease holder: unused
    assert parsed.metrics_port == 9090
    assert parsed.standalone is False  # replicas elect one leader through the Lease


def test_service_monitor_scrapes_the_metrics_port(helm_bin: Path) -> None:
    objects = render(helm_bin, ALL_ON)
    monitor = find(objects, "ServiceMonitor")
    service = find(objects, "Service")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"] == "metrics"
    metrics_port = next(p for p in container(objects)["ports"] if p["name"] == "metrics")
    assert service["spec"]["ports"][0]["port"] == metrics_port["containerPort"]
    failed = helm(
        helm_bin,
        "template",
        str(CHART),
        *set_args({"metrics.serviceMonitor.enabled": "true", "metrics.service.enabled": "false"}),
        check=False,
    )
    assert failed.returncode != 0 and "metrics.service.enabled" in failed.stderr


def test_chart_crds_are_the_generated_ones() -> None:
    for chart_crd in sorted((CHART / "crds").glob("*.yaml")):
        assert chart_crd.read_text() == (ROOT / "crds" / chart_crd.name).read_text()
    names = {p.name for p in (CHART / "crds").glob("*.yaml")}
    assert names == {p.name for p in (ROOT / "crds").glob("*.yaml")}


def exported_names() -> set[str]:
    """Sample names the runtime and the operator really export (their own registries)."""
    stats = EngineStats(0, 0, 1, 1, 0.0, 0, 0, 0)
    runtime = runtime_metrics.ServerMetrics("m", lambda: stats).render().decode()
    operator = observability.OperatorMetrics()
    observability.record_reconcile(0.1, "success", operator)
    observability.record_plan_failure("no-fit", operator)
    observability.record_scale("up", operator)
    observability.record_metrics_error("pods", operator)
    text = runtime + operator.exposition().decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_dashboard_queries_series_that_exist(helm_bin: Path) -> None:
    dashboard = json.loads((CHART / "dashboards" / "kvpilot.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    series = {m for e in exprs for m in re.findall(r"\b(kvpilot_[a-z_]+)\s*[{\[]", e)}
    assert series and series <= exported_names(), series - exported_names()
    # Every other kvpilot_ word is a label kubernetes_sd relabelling puts on the runtime series,
    # the same labels the autoscaler's PromQL groups by.
    labels = {m for e in exprs for m in re.findall(r"\b(kvpilot_[a-z_]+)\b", e)} - series
    assert labels == {operator_metrics.PROM_LABEL_MODEL, operator_metrics.PROM_LABEL_NODE_TYPE}
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in (
        "queue",
        "kv-cache",
        "time to first token",
        "inter-token",
        "tokens per second",
        "replicas per node type",
        "scale decisions",
    ):
        assert topic in titles
    cm = find(render(helm_bin, {"dashboard.enabled": "true"}), "ConfigMap", "kvpilot-dashboard")
    assert json.loads(cm["data"]["kvpilot.json"]) == dashboard
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_argocd_applications_point_at_what_exists(helm_bin: Path, tmp_path: Path) -> None:
    apps = {
        a["metadata"]["name"]: a
        for a in yaml.safe_load_all((ROOT / "examples" / "argocd" / "application.yaml").read_text())
    }
    operator_source = apps["kvpilot-operator"]["spec"]["source"]
    assert (ROOT / operator_source["path"] / "Chart.yaml").is_file()
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(operator_source["helm"]["valuesObject"]))
    objects = render(helm_bin, extra=["-f", str(values)])  # the chart's schema accepts them
    config_map = config_yaml(objects)
    assert config_map["prometheusUrl"] == "http://prometheus-operated.monitoring:9090"
    models = apps["kvpilot-models"]["spec"]["source"]
    assert (ROOT / models["path"] / models["directory"]["include"]).is_file()
    for app in apps.values():
        assert "ServerSideApply=true" in app["spec"]["syncPolicy"]["syncOptions"]
