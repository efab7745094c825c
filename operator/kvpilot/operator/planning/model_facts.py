"""Architecture facts of hf:// and s3:// models the catalog lacks, read at the source.

Only config.json and the safetensors headers are read (runtime/remote_config.py), with the
endpoints of the ModelDeployment's `spec.runtime.env` and the Secret its `spec.model.secretRef`
names — what its pods would use. Facts are kept per (namespace, URI): a model's architecture does
not change under a URI the user did not change, so a re-plan costs no network.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

from kubernetes import client as k8s_client
from kubernetes.client.rest import ApiException

from kvpilot.contract import catalog
from kvpilot.contract.fetch import FetchError
from kvpilot.contract.memory import ModelFacts
from kvpilot.contract.model_source import parse_model_uri
from kvpilot.contract.remote_config import count_parameters, read_config_json
from kvpilot.operator import api


@dataclass
class ModelFactsReader:
    client: k8s_client.ApiClient
    _known: dict[tuple[str, str], ModelFacts] = field(default_factory=dict)

    def read(self, namespace: str, spec: api.ModelDeploymentSpec, uri: str) -> ModelFacts:
        """The facts of `uri`: spec.model's, or its speculative draft model's (fetched with the
        same credentials). ValueError in one line (the URI, the cause, the remedy) when the
        source says no."""
        key = (namespace, uri)
        if key not in self._known:
            source = parse_model_uri(uri)
            env, note = self._env(namespace, spec)
            which = "model" if uri == spec.model.uri else "draft model"
            try:
                config = read_config_json(source, env)
                facts = catalog.facts_from_config(config, count_parameters(source, env))
            except (FetchError, KeyError, ValueError) as error:
                raise ValueError(f"cannot read the {which}'s config.json: {error}{note}") from error
            self._known[key] = facts
        return self._known[key]

    def _env(self, namespace: str, spec: api.ModelDeploymentSpec) -> tuple[dict[str, str], str]:
        """The pods' endpoints and, where the operator may read it, their Secret; else a note
        that says how to give the operator the Secret (the chart's rbac.readModelSecrets)."""
        env = {e.name: e.value for e in spec.runtime.env}
        ref = spec.model.secret_ref
        if ref is None:
            return env, ""
        try:
            secret = k8s_client.CoreV1Api(self.client).read_namespaced_secret(ref.name, namespace)
        except ApiException as error:
            if error.status == 404:
                raise ValueError(
                    f"spec.model.secretRef: Secret {ref.name} not found in namespace {namespace}"
                ) from error
            if error.status == 403:  # an opt-in right: public sources need no Secret
                return env, (
                    f" (read without Secret {ref.name}: the operator may not read Secrets; set"
                    " the chart's rbac.readModelSecrets=true, or give spec.model parameters,"
                    " layers, kvHeads and headDim)"
                )
            raise
        data = secret.data or {}
        return env | {k: base64.b64decode(v).decode() for k, v in data.items()}, ""


def needs_reading(model: api.ModelSource) -> bool:
    """Neither the spec nor the catalog has the facts, and the source can be read from here."""
    try:
        catalog.resolve(model)
    except ValueError:
        return parse_model_uri(model.uri).is_fetched
    return False
