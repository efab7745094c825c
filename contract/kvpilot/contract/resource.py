"""The ModelDeployment resource as every process names it: its API group, version and kind, the
annotation and label keys the operator, the gateway and Prometheus share, and the served name.

The operator owns the schema (operator/api.py generates the CRD); the gateway watches the same
objects and the pods they make, so the names both sides use live here, once.
"""

from __future__ import annotations

from kvpilot.contract.model_source import parse_model_uri

GROUP = "kvpilot.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"
SINGULAR = "modeldeployment"
SHORT_NAMES = ("md", "mdeploy")

# kvpilot-gateway stamps this (RFC 3339, UTC) on a ModelDeployment whose requests it holds while
# nothing runs; the operator then asks for a replica at once (policy.wake, handlers.md_wake).
WAKE_ANNOTATION = "kvpilot.dev/wake-requested-at"

# On every pod of a ModelDeployment: its name, and the node type its Deployment was planned for
# (the second is also the Node label that names a node's type where GPU Feature Discovery's do
# not). The gateway finds a model's replicas by the first; Prometheus relabels both.
LABEL_MODEL = "kvpilot.dev/model"
LABEL_NODE_TYPE = "kvpilot.dev/node-type"


def served_name(uri: str, given: str | None = None) -> str:
    """The model id clients send: `spec.model.servedName` when given, else the last path
    element of `spec.model.uri` (without an hf:// @revision)."""
    return given or parse_model_uri(uri).name
