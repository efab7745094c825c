"""A Helm release of the chart in the dev cluster, and a kubeconfig that acts as its
ServiceAccount (a token from `kubectl create token`), for the least-privilege tests."""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.helm_chart import CHART, helm, set_args


@dataclass
class Release:
    cluster: Any
    helm_bin: Path
    name: str
    namespace: str
    part: str = "operator"  # whose identity can()/can_i() ask about: operator or gateway

    @classmethod
    def new(cls, cluster: Any, helm_bin: Path, prefix: str) -> Release:
        suffix = uuid.uuid4().hex[:6]
        return cls(cluster, helm_bin, f"{prefix}{suffix}", f"{prefix}-{suffix}")

    @property
    def fullname(self) -> str:
        """The part's objects' name (Deployment, ServiceAccount, ClusterRole)."""
        base = f"{self.name}-kvpilot"
        return f"{base}-gateway" if self.part == "gateway" else base

    def gateway(self) -> Release:
        """The same release, seen as its gateway (the gateway's ServiceAccount and names)."""
        return dataclasses.replace(self, part="gateway")

    @property
    def service_account(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.fullname}"

    def helm(self, *args: str, check: bool = True) -> str:
        ns = ["--namespace", self.namespace]
        done = helm(self.helm_bin, *args, *ns, env=self.cluster.env, check=check)
        return done.stdout + done.stderr

    def install(self, values: dict[str, str] | None = None) -> str:
        args = ["install", self.name, str(CHART), "--create-namespace"]
        return self.helm(*args, *set_args(values or {}))

    def upgrade(self, values: dict[str, str]) -> str:
        args = ["upgrade", self.name, str(CHART), "--reuse-values"]
        return self.helm(*args, *set_args(values))

    def uninstall(self) -> str:
        return self.helm("uninstall", self.name, "--wait", "--timeout", "60s", check=False)

    def can_i(self, *args: str) -> bool:
        """`kubectl auth can-i ... --as=<the ServiceAccount>` (resources the server knows)."""
        done = self.cluster.kubectl(
            "auth", "can-i", *args, f"--as={self.service_account}", check=False
        )
        answer = done.stdout.strip()
        assert answer in ("yes", "no"), done.stdout + done.stderr
        return answer == "yes"

    def can(
        self, verb: str, resource: str, namespace: str = "", subresource: str = "", name: str = ""
    ) -> bool:
        """A SubjectAccessReview for the ServiceAccount: `resource` is `plural[.group]`. Exact
        even for resources whose CRD is not installed, where kubectl's discovery cannot help."""
        plural, _, group = resource.partition(".")
        attributes = {"verb": verb, "group": group, "resource": plural}
        attributes |= {"namespace": namespace} if namespace else {}
        attributes |= {"subresource": subresource} if subresource else {}
        attributes |= {"name": name} if name else {}
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": self.service_account,
                "groups": [
                    "system:serviceaccounts",
                    f"system:serviceaccounts:{self.namespace}",
                    "system:authenticated",
                ],
                "resourceAttributes": attributes,
            },
        }
        out = self.cluster.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(review))
        return bool(json.loads(out.stdout)["status"].get("allowed", False))

    def config_yaml(self) -> str:
        name = f"{self.fullname}-config"
        cm = self.cluster.kubectl("get", "configmap", name, "-n", self.namespace, "-o", "json")
        return str(json.loads(cm.stdout)["data"]["config.yaml"])

    def service_account_kubeconfig(self, path: Path) -> Path:
        """The cluster's kubeconfig with the user swapped for the ServiceAccount's token."""
        token = self.cluster.kubectl(
            "create", "token", self.fullname, "-n", self.namespace, "--duration=1h"
        ).stdout.strip()
        admin = yaml.safe_load(Path(self.cluster.kubeconfig).read_text())
        context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])
        cluster = next(c for c in admin["clusters"] if c["name"] == context["context"]["cluster"])
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [cluster],
            "users": [{"name": "operator", "user": {"token": token}}],
            "contexts": [
                {"name": "operator", "context": {"cluster": cluster["name"], "user": "operator"}}
            ],
            "current-context": "operator",
        }
        path.write_text(yaml.safe_dump(config))
        return path
