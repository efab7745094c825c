"""Pure parts of a local pod's API access: projected volumes, the in-cluster kubeconfig, env."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import config as k8s_config
from kubernetes.client import Configuration

from hack.podrunner import apiaccess

POD: dict[str, Any] = {
    "metadata": {"name": "gw-0", "namespace": "ml", "uid": "u1"},
    "spec": {"serviceAccountName": "gw", "containers": [{"name": "gateway"}]},
}
# What the ServiceAccount admission plugin adds to a pod that automounts its token.
KUBE_API_ACCESS = {
    "name": "kube-api-access-x1",
    "projected": {
        "sources": [
            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
            {
                "configMap": {
                    "name": "kube-root-ca.crt",
                    "items": [{"key": "ca.crt", "path": "ca.crt"}],
                }
            },
            {
                "downwardAPI": {
                    "items": [
                        {"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}
                    ]
                }
            },
        ]
    },
}


def sources(config_maps: dict[str, dict[str, str]], asked: list[Any] | None = None) -> Any:
    def token(audiences: list[str], seconds: int) -> apiaccess.IssuedToken:
        if asked is not None:
            asked.append((audiences, seconds))
        return apiaccess.IssuedToken("tok", 1000.0)

    return apiaccess.Sources(
        token=token,
        config_map=lambda ns, name: config_maps.get(f"{ns}/{name}"),
        secret=lambda ns, name: None,
    )


def test_the_kube_api_access_volume_holds_token_ca_and_namespace() -> None:
    asked: list[Any] = []
    found = apiaccess.project(
        KUBE_API_ACCESS, POD, sources({"ml/kube-root-ca.crt": {"ca.crt": "PEM"}}, asked)
    )
    assert found.files == {"token": "tok", "ca.crt": "PEM", "namespace": "ml"}
    assert found.token_lifetime_s == 1000.0
    assert asked == [([], 3607)]  # no audience: the API server's own


@pytest.mark.parametrize(
    ("source", "data", "expected"),
    [
        ({"name": "cm"}, {"a": "1", "b": "2"}, {"a": "1", "b": "2"}),  # no items: every key
        ({"name": "cm", "items": [{"key": "a", "path": "x/a"}]}, {"a": "1"}, {"x/a": "1"}),
        ({"name": "gone", "optional": True}, None, {}),
        ({"name": "cm", "optional": True, "items": [{"key": "z", "path": "z"}]}, {"a": "1"}, {}),
    ],
)
def test_config_map_sources(
    source: dict[str, Any], data: dict[str, str] | None, expected: dict[str, str]
) -> None:
    volume = {"name": "v", "projected": {"sources": [{"configMap": source}]}}
    maps = {} if data is None else {f"ml/{source['name']}": data}
    found = apiaccess.project(volume, POD, sources(maps))
    assert (found.files, found.token_lifetime_s) == (expected, None)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"configMap": {"name": "kube-root-ca.crt"}}, 'ConfigMap "kube-root-ca.crt" not found'),
        (
            {"configMap": {"name": "cm", "items": [{"key": "z", "path": "z"}]}},
            "couldn't find key z in ConfigMap ml/cm",
        ),
        ({"secret": {"name": "s"}}, 'Secret "s" not found'),
        (
            {
                "downwardAPI": {
                    "items": [{"path": "l", "fieldRef": {"fieldPath": "metadata.labels"}}]
                }
            },
            "downwardAPI field 'metadata.labels' is not supported",
        ),
    ],
)
def test_what_cannot_be_projected_is_named(source: dict[str, Any], message: str) -> None:
    volume = {"name": "v", "projected": {"sources": [source]}}
    with pytest.raises(ValueError, match=message):
        apiaccess.project(volume, POD, sources({"ml/cm": {"a": "1"}}))


def test_only_projected_volumes_are_filled() -> None:
    pod = {
        **POD,
        "spec": {**POD["spec"], "volumes": [{"name": "tmp", "emptyDir": {}}, KUBE_API_ACCESS]},
    }
    assert [v["name"] for v in apiaccess.projected_volumes(pod)] == ["kube-api-access-x1"]


@pytest.mark.parametrize(
    ("mounts", "expected"),
    [
        ([(apiaccess.SERVICE_ACCOUNT_DIR, "/state/pods/u1/volumes/k")], "/state/pods/u1/volumes/k"),
        ([("/tmp", "/state/pods/u1/volumes/tmp")], None),
        ([], None),
    ],
)
def test_service_account_dir(mounts: list[tuple[str, str]], expected: str | None) -> None:
    assert apiaccess.service_account_dir(mounts) == expected


def test_the_kubeconfig_is_what_the_kubernetes_client_loads(tmp_path: Path) -> None:
    """The real client reads it: server, CA file and the token from tokenFile."""
    (tmp_path / "token").write_text("the-pods-token")
    (tmp_path / "ca.crt").write_text("PEM")
    path = tmp_path / "kubeconfig"
    doc = apiaccess.kubeconfig("https://127.0.0.1:6443", str(tmp_path), "ml")
    path.write_text(yaml.safe_dump(doc))
    loaded = Configuration()
    k8s_config.load_kube_config(config_file=str(path), client_configuration=loaded)
    assert loaded.host == "https://127.0.0.1:6443"
    assert loaded.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert loaded.api_key == {"BearerToken": "Bearer the-pods-token"}
    assert k8s_config.list_kube_config_contexts(str(path))[1]["context"]["namespace"] == "ml"


@pytest.mark.parametrize(
    ("kubeconfig", "expected"),
    [
        (
            Path("/p/kubeconfig"),
            {
                "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": "6443",
                "KUBERNETES_SERVICE_PORT_HTTPS": "6443",
                "KUBECONFIG": "/p/kubeconfig",
            },
        ),
        (
            None,  # automountServiceAccountToken: false — the address, no credentials
            {
                "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": "6443",
                "KUBERNETES_SERVICE_PORT_HTTPS": "6443",
            },
        ),
    ],
)
def test_api_env(kubeconfig: Path | None, expected: dict[str, str]) -> None:
    assert apiaccess.api_env("https://127.0.0.1:6443", kubeconfig) == expected


def test_a_pod_never_inherits_the_runners_kubeconfig() -> None:
    runner = {"KUBECONFIG": "/admin/kubeconfig", "PATH": "/bin", "PYTHONPATH": "/src"}
    assert apiaccess.inherited_env(runner) == {"PATH": "/bin", "PYTHONPATH": "/src"}


def test_tokens_are_renewed_at_80_percent_of_their_lifetime() -> None:
    assert apiaccess.renew_after_s(3600.0) == pytest.approx(2880.0)
