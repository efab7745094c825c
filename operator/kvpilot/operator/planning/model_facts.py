"""Architecture facts of hf:// and s3:// models the catalog lacks, read at the source, and of
file:// and pvc:// models from the config.json their spec.model.configMapRef names.

Only config.json and the safetensors headers are read (runtime/remote_config.py), with the
endpoints of the ModelDeployment's `spec.runtime.env` and the Secret its `spec.model.secretRef`
names — what its pods would use. Facts are kept per (namespace, URI): a model's architecture does
not change under a URI the user did not change, so a re-plan costs no network. A ConfigMap is read
each pass (one GET): it may be created or fixed after the ModelDeployment.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s_client
from kubernetes.client.rest import ApiException

from kvpilot.contract import catalog, checkpoint_weights
from kvpilot.contract.fetch import FetchError
from kvpilot.contract.memory import ModelFacts
from kvpilot.contract.model_source import parse_model_uri
from kvpilot.contract.remote_config import count_parameters, read_config_json
from kvpilot.operator import api

# Where a file:// or pvc:// model's config.json comes from (a node's path, a claim: not here)
CONFIG_MAP_FIELD = "spec.model.configMapRef"


class UnservableCheckpointError(ValueError):
    """The source was read, and the runtime would refuse its checkpoint (its
    quantization_config): reading it again cannot help, the spec must name another."""


@dataclass
class ModelFactsReader:
    client: k8s_client.ApiClient
    _known: dict[tuple[str, str], ModelFacts] = field(default_factory=dict)

    def read(
        self,
        namespace: str,
        spec: api.ModelDeploymentSpec,
        uri: str,
        variant: api.ModelVariant | None = None,
    ) -> ModelFacts:
        """The facts of `uri`: spec.model's, its speculative draft model's (fetched with the
        same credentials), or a `variant`'s (with its own secretRef, if it has one). ValueError
        in one line (the URI, the cause, the remedy) when the source says no."""
        key = (namespace, uri)
        if key not in self._known:
            source = parse_model_uri(uri)
            env, note = self._env(namespace, spec, *_secret_for(spec, variant))
            which = "model" if uri == spec.model.uri else "draft model"
            which = which if variant is None else f"variant {variant.name}"
            try:
                config = read_config_json(source, env)
            except (FetchError, KeyError, ValueError) as error:
                raise ValueError(f"cannot read the {which}'s config.json: {error}{note}") from error
            self._known[key] = facts_from_config_json(
                config, lambda: count_parameters(source, env), which, note
            )
        return self._known[key]

    def read_config_map(self, namespace: str, ref: api.ConfigMapKeyRef) -> ModelFacts:
        """The facts of the config.json spec.model.configMapRef names (facts_from_config_map);
        ValueError naming the field and what to do."""
        try:
            found = k8s_client.CoreV1Api(self.client).read_namespaced_config_map(
                ref.name, namespace
            )
        except ApiException as error:
            if error.status == 403:  # an operator installed without the chart's rights
                raise ValueError(
                    f"{CONFIG_MAP_FIELD}: the operator may not read ConfigMap {ref.name} in"
                    f" namespace {namespace}: grant it get on configmaps (the chart does)"
                ) from error
            if error.status != 404:
                raise
            return facts_from_config_map(None, ref, namespace)
        return facts_from_config_map(found.data or {}, ref, namespace)

    def _env(
        self, namespace: str, spec: api.ModelDeploymentSpec, ref: api.SecretRef | None, where: str
    ) -> tuple[dict[str, str], str]:
        """The pods' endpoints and, where the operator may read it, their Secret `ref`; else a
        note that says how to give the operator the Secret (the chart's rbac.readModelSecrets)."""
        env = {e.name: e.value for e in spec.runtime.env}
        if ref is None:
            return env, ""
        try:
            secret = k8s_client.CoreV1Api(self.client).read_namespaced_secret(ref.name, namespace)
        except ApiException as error:
            if error.status == 404:
                raise ValueError(
                    f"{where}.secretRef: Secret {ref.name} not found in namespace {namespace}"
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


def _secret_for(
    spec: api.ModelDeploymentSpec, variant: api.ModelVariant | None
) -> tuple[api.SecretRef | None, str]:
    """The Secret a source is fetched with, and the field that names it."""
    if variant is not None and variant.secret_ref is not None:
        return variant.secret_ref, f"spec.model.variants[{variant.name}]"
    return spec.model.secret_ref, "spec.model"


def facts_from_config_json(
    config: dict[str, Any], count: Callable[[], int], which: str, note: str
) -> ModelFacts:
    """Facts from a read config.json; `count` reads a 16-bit checkpoint's parameter count (a
    pre-quantised one's comes from its shapes). ValueError naming what the runtime would refuse
    (e.g. `quantization_config.bits: 3 is not supported`) or what the config lacks."""
    try:
        checkpoint = checkpoint_weights.read_checkpoint_weights(config)
    except ValueError as error:
        why = f"the {which}'s checkpoint cannot be served: {error}"
        raise UnservableCheckpointError(why) from error
    try:
        parameters = checkpoint_weights.architecture_parameters(config) if checkpoint else count()
        return catalog.facts_from_config(config, parameters, checkpoint)
    except (FetchError, KeyError, ValueError) as error:
        raise ValueError(f"cannot read the {which}'s config.json: {error}{note}") from error


def facts_from_config_map(
    data: Mapping[str, str] | None, ref: api.ConfigMapKeyRef, namespace: str
) -> ModelFacts:
    """Facts from the config.json in spec.model.configMapRef's ConfigMap (`data`; None: the
    ConfigMap is not there), planned as a read one is: the architecture, and a pre-quantised
    checkpoint's level and bytes. Parameters come from the shapes (the operator cannot read a
    node's safetensors headers). ValueError naming the field and what to do, for a missing
    ConfigMap or key, a value that is not a JSON object, or a checkpoint the runtime refuses."""
    where = f"{CONFIG_MAP_FIELD} (ConfigMap {ref.name}, key {ref.key})"
    create = (
        f"kubectl create configmap {ref.name} -n {namespace}"
        f" --from-file={ref.key}=CHECKPOINT/config.json"
    )
    if data is None:
        raise ValueError(
            f"{where}: ConfigMap {ref.name} not found in namespace {namespace}: {create}"
        )
    if ref.key not in data:
        keys = ", ".join(sorted(data)) or "none"
        raise ValueError(
            f"{where}: the ConfigMap has no key {ref.key} (its keys: {keys}): set"
            f" {CONFIG_MAP_FIELD}.key, or {create}"
        )
    try:
        config = json.loads(data[ref.key])
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{where}: not JSON ({error}): it must hold the checkpoint's config.json"
        ) from error
    if not isinstance(config, dict):
        raise ValueError(f"{where}: not a JSON object: it must hold the checkpoint's config.json")
    try:
        return facts_from_config_json(
            config, lambda: checkpoint_weights.architecture_parameters(config), "model", ""
        )
    except UnservableCheckpointError as error:
        raise ValueError(
            f"{where}: {error}; serve a checkpoint the runtime supports (or, if this is not the"
            " checkpoint's own config.json, put that one in the ConfigMap)"
        ) from error
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from error


def local_source_note(model: api.ModelSource) -> str:
    """The Planned message's note for a file:// or pvc:// spec.model the catalog lacks and no
    configMapRef describes: the operator cannot read its config.json (a node's path, a claim),
    so it plans the stated facts as a 16-bit checkpoint and cannot know whether it is
    pre-quantised; '' for other sources."""
    source = parse_model_uri(model.uri)
    if source.is_fetched or catalog.lookup(model.uri) is not None or model.config_map_ref:
        return ""
    return (
        "; planned from spec.model's facts as a 16-bit checkpoint: the operator does not read"
        f" {source.scheme}:// sources, so a pre-quantised one (quantization_config in its"
        " config.json) is not planned at its own level and bytes, and its pods refuse another"
        " level at start; give its config.json in a ConfigMap that spec.model.configMapRef"
        " names, where it is read"
    )


def needs_reading(model: api.ModelSource) -> bool:
    """The source can be read from here and the catalog lacks it. Architecture facts stated in
    the spec do not spare the read: they do not say whether the checkpoint is pre-quantised,
    which the runtime reads from config.json at start (a conflicting --quantization refused)."""
    return parse_model_uri(model.uri).is_fetched and catalog.lookup(model.uri) is None
