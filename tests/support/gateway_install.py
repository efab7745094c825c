"""The chart's gateway in front of one ModelDeployment on the dev cluster, with the operator
beside it (its autoscaler reading the cluster's Prometheus): what the e2e tests of the gateway
install, and remove after them."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from hack import closedloop
from hack.devcluster import chart, procs
from tests.support.kube import fresh_namespace, wait_until


@dataclass(frozen=True)
class Install:
    url: str  # the gateway Service's base URL, reached through the dev cluster's service proxy
    namespace: str
    release: str


@contextlib.contextmanager
def gateway_in_front(
    cluster: Any, prefix: str, model_deployment: dict[str, Any], settings: Sequence[str] = ()
) -> Iterator[Install]:
    """`helm install` (with more helm `settings`) and `model_deployment` in a namespace of their
    own (`prefix-<random>`); `prefix` names the operator's and the service proxy's processes."""
    if not hasattr(cluster, "start_process"):
        pytest.skip("needs the dev cluster (pod runner, Prometheus, local processes)")
    closedloop.apply_crds(cluster)
    release = f"{prefix.replace('-', '')[:4]}{uuid.uuid4().hex[:6]}"
    name = model_deployment["metadata"]["name"]
    operator, proxy = f"{prefix}-operator", f"{prefix}-gateway-proxy"
    with fresh_namespace(cluster, prefix) as namespace:
        closedloop.start_operator(cluster, operator, 2)
        try:
            chart.helm_install(cluster, release, namespace, settings=settings)
            doc = {**model_deployment, "metadata": {**model_deployment["metadata"]}}
            doc["metadata"]["namespace"] = namespace
            cluster.kubectl("apply", "-f", "-", input=json.dumps(doc))
            service = chart.gateway_service(cluster, release, namespace)
            url = closedloop.start_proxy(cluster, proxy, service, namespace)
            wait_until(lambda: procs.http_ok(f"{url}/health"), 120, "the gateway Service")
            yield Install(url, namespace, release)
        finally:
            cluster.kubectl("delete", "modeldeployment", name, "-n", namespace, check=False)
            cluster.stop_process(proxy)
            cluster.stop_process(operator)
            uninstall = ["uninstall", release, "-n", namespace, "--wait", "--timeout", "60s"]
            chart.helm(cluster, *uninstall, check=False)
