"""The names and labels every child of a ModelDeployment carries, and its owner reference.

Deterministic, so every pass builds the same ones: a child is named after the ModelDeployment
and its node type, a model cache's claim after its source (volumes.cache_claim_name), and a pod
template carries a hash of what it holds (`spec_hash`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kvpilot.contract import resource
from kvpilot.contract.resource import LABEL_MODEL, LABEL_NODE_TYPE

LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
ANNOTATION_SPEC_HASH = "kvpilot.dev/spec-hash"
MANAGED_BY = "kvpilot-operator"
MAX_NAME = 63

Obj = Mapping[str, Any]


def child_name(md_name: str, node_type: str) -> str:
    """`<name>-<node type>`, shortened with a stable hash when it would pass 63 characters."""
    name = f"{md_name}-{node_type}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: MAX_NAME - 9].rstrip('-')}-{digest}"


def selector_labels(md_name: str) -> dict[str, str]:
    return {LABEL_MODEL: md_name}


def labels(md_name: str, node_type: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "kvpilot-runtime",
        "app.kubernetes.io/instance": md_name,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_MODEL: md_name,
    }
    if node_type:
        out[LABEL_NODE_TYPE] = node_type
    return out


def owner_reference(md: Obj) -> dict[str, Any]:
    meta = md["metadata"]
    return {
        "apiVersion": f"{resource.GROUP}/{resource.VERSION}",
        "kind": resource.KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def spec_hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]
