"""A pod's access to the API server, as the kubelet gives it (pure pieces; runner.py does the I/O).

The apiserver's ServiceAccount admission adds a projected volume to every pod that automounts a
token (`kube-api-access-*`: a token for the pod's ServiceAccount, the `kube-root-ca.crt`
ConfigMap's ca.crt, the namespace), mounted at SERVICE_ACCOUNT_DIR. The runner fills that
volume's local directory the way the kubelet fills the mount: a TokenRequest bound to the pod,
the ConfigMap's key, the downward-API field.

A local process cannot see a mount at /var/run/secrets/..., where in-cluster clients look. So the
runner also writes a kubeconfig naming those files (`tokenFile`, `certificate-authority`) and
points KUBECONFIG at it: every Kubernetes client reads KUBECONFIG before it tries in-cluster
config, and nothing in kvpilot needs to know it runs under the dev cluster. A pod never inherits
the runner's own (admin) KUBECONFIG, so what it may do is exactly what its ServiceAccount's RBAC
grants.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# What the admission plugin asks for; the apiserver may extend it (a bound token of 3607 s is
# issued for a year when --service-account-extend-token-expiration is on, its default).
DEFAULT_TOKEN_SECONDS = 3607
# The kubelet renews a projected token once 80% of its lifetime has passed.
RENEW_AT_FRACTION = 0.8

FIELD_PATHS = {
    "metadata.name": lambda pod: pod["metadata"]["name"],
    "metadata.namespace": lambda pod: pod["metadata"]["namespace"],
    "metadata.uid": lambda pod: pod["metadata"].get("uid", ""),
    "spec.serviceAccountName": lambda pod: pod["spec"].get("serviceAccountName", "default"),
}


@dataclass(frozen=True)
class IssuedToken:
    token: str
    lifetime_s: float  # from issue to expiry, as the apiserver granted it


@dataclass(frozen=True)
class Sources:
    """Where a projected volume's data comes from (the runner's API calls).

    token(audiences, seconds) -> the pod's ServiceAccount token; config_map / secret (namespace,
    name) -> its data, None when absent."""

    token: Callable[[list[str], int], IssuedToken]
    config_map: Callable[[str, str], Mapping[str, str] | None]
    secret: Callable[[str, str], Mapping[str, str] | None]


@dataclass(frozen=True)
class Projection:
    files: dict[str, str]  # path inside the volume -> content
    token_lifetime_s: float | None  # None: no token in it


def projected_volumes(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in pod["spec"].get("volumes") or [] if "projected" in v]


def project(volume: dict[str, Any], pod: dict[str, Any], sources: Sources) -> Projection:
    """The files of one projected volume. A missing ConfigMap/Secret (or key) that is not
    optional is a ValueError naming it, as the kubelet's FailedMount."""
    namespace = pod["metadata"]["namespace"]
    files: dict[str, str] = {}
    lifetime: float | None = None
    for source in volume["projected"].get("sources") or []:
        if "serviceAccountToken" in source:
            wanted = source["serviceAccountToken"]
            audience = wanted.get("audience")
            seconds = int(wanted.get("expirationSeconds") or DEFAULT_TOKEN_SECONDS)
            issued = sources.token([audience] if audience else [], seconds)
            files[wanted["path"]] = issued.token
            lifetime = issued.lifetime_s
        elif "configMap" in source:
            files |= _keyed_files(source["configMap"], "ConfigMap", namespace, sources.config_map)
        elif "secret" in source:
            files |= _keyed_files(source["secret"], "Secret", namespace, sources.secret)
        elif "downwardAPI" in source:
            files |= _downward_files(source["downwardAPI"], pod)
    return Projection(files, lifetime)


def _keyed_files(
    ref: dict[str, Any],
    kind: str,
    namespace: str,
    read: Callable[[str, str], Mapping[str, str] | None],
) -> dict[str, str]:
    data = read(namespace, ref["name"])
    optional = bool(ref.get("optional"))
    if data is None:
        if optional:
            return {}
        raise ValueError(f'{kind} "{ref["name"]}" not found (namespace {namespace})')
    items = ref.get("items") or [{"key": key, "path": key} for key in data]
    files: dict[str, str] = {}
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise ValueError(f"couldn't find key {item['key']} in {kind} {namespace}/{ref['name']}")
        files[item["path"]] = data[item["key"]]
    return files


def _downward_files(downward: dict[str, Any], pod: dict[str, Any]) -> dict[str, str]:
    files: dict[str, str] = {}
    for item in downward.get("items") or []:
        field = (item.get("fieldRef") or {}).get("fieldPath")
        if field not in FIELD_PATHS:
            raise ValueError(f"downwardAPI field {field!r} is not supported by the pod runner")
        files[item["path"]] = FIELD_PATHS[field](pod)
    return files


def renew_after_s(lifetime_s: float) -> float:
    return lifetime_s * RENEW_AT_FRACTION


def service_account_dir(mounts: Sequence[tuple[str, str]]) -> str | None:
    """The local directory the container sees as SERVICE_ACCOUNT_DIR, if it mounts one."""
    return next((local for path, local in mounts if path == SERVICE_ACCOUNT_DIR), None)


def kubeconfig(server: str, account_dir: str, namespace: str) -> dict[str, Any]:
    """A kubeconfig that is the in-cluster config: the API server, the mounted CA and token."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "in-cluster",
        "clusters": [
            {
                "name": "in-cluster",
                "cluster": {"server": server, "certificate-authority": f"{account_dir}/ca.crt"},
            }
        ],
        # tokenFile, not token: clients that re-read it (client-go) see the renewed token.
        "users": [{"name": "service-account", "user": {"tokenFile": f"{account_dir}/token"}}],
        "contexts": [
            {
                "name": "in-cluster",
                "context": {
                    "cluster": "in-cluster",
                    "user": "service-account",
                    "namespace": namespace,
                },
            }
        ],
    }


def api_env(server: str, kubeconfig_path: Path | None) -> dict[str, str]:
    """KUBERNETES_SERVICE_HOST/PORT, which the kubelet gives every pod (here the API server's
    own address: Service IPs route nowhere on this machine), and KUBECONFIG when the pod mounts
    a token."""
    address = urlsplit(server)
    port = str(address.port or 443)
    env = {
        "KUBERNETES_SERVICE_HOST": address.hostname or "",
        "KUBERNETES_SERVICE_PORT": port,
        "KUBERNETES_SERVICE_PORT_HTTPS": port,
    }
    if kubeconfig_path is not None:
        env["KUBECONFIG"] = str(kubeconfig_path)
    return env


def inherited_env(runner_env: Mapping[str, str]) -> dict[str, str]:
    """The runner's environment minus its credentials: a pod acts as its ServiceAccount only."""
    return {key: value for key, value in runner_env.items() if key != "KUBECONFIG"}
