"""Where the runtime pod holds what it serves: the volumes and mounts for the model source
(a model cache's claim, a pvc:// claim, or an emptyDir an init container fetches into), the
speculative draft model, the KV disk tier, and the claims pvc:// adapters name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvpilot.contract.model_source import parse_model_uri
from kvpilot.operator import api
from kvpilot.operator.reconcile.naming import spec_hash

MODEL_MOUNT = "/mnt/models"
DRAFT_MOUNT = "/mnt/draft-model"  # speculative draft_model: fetched by its own init container
DRAFT_VOLUME = "draft-model"
CACHE_MOUNT = "/var/cache/kvpilot"
KV_DISK_MOUNT = "/var/lib/kvpilot/kv-offload"  # spec.runtime.kvOffload.disk's volume
KV_DISK_VOLUME = "kv-offload"
LORA_CLAIMS_MOUNT = "/mnt/lora-claims"  # pvc:// adapters' claims, each at its name under it
# An emptyDir disk tier's sizeLimit over its budget: each block file's header, and the one file
# being written under a temporary name, are not counted in the runtime's budget.
KV_DISK_HEADROOM = 1.05
GIB, MIB = api.GIB, api.MIB
# An emptyDir: the one writable scratch under readOnlyRootFilesystem (it hides what the image, or a
# local-pool node, has at that path).
SCRATCH_MOUNT = "/tmp"


@dataclass(frozen=True)
class ModelMount:
    """How the pod reaches the model: the --model value, the volume and mounts that hold it,
    and for hf:// and s3:// the init container that fetches it into that volume."""

    model_arg: str
    volumes: list[dict[str, Any]]
    mounts: list[dict[str, Any]]
    needs_fetch: bool


def cache_claim_name(uri: str) -> str:
    """The model cache's claim (and fill Job) name: one per model source in a namespace, so
    ModelDeployments of the same model share it."""
    return f"kvpilot-model-cache-{spec_hash(uri)}"


def model_location(model: api.ModelSource) -> ModelMount:
    source = parse_model_uri(model.uri)
    read_only_mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    if model.cache is not None:  # filled once by the cache Job (reconcile/model_cache.py)
        claim = {"claimName": cache_claim_name(model.uri), "readOnly": True}
        volume = {"name": "model", "persistentVolumeClaim": claim}
        return ModelMount(f"file://{MODEL_MOUNT}", [volume], [read_only_mount], needs_fetch=False)
    if source.scheme == "pvc":
        claim = {"claimName": source.location, "readOnly": True}
        volume = {"name": "model", "persistentVolumeClaim": claim}
        path = f"file://{MODEL_MOUNT}/{source.path}".rstrip("/")
        return ModelMount(path, [volume], [read_only_mount], needs_fetch=False)
    if source.is_fetched:
        volume = {"name": "model", "emptyDir": {}}
        return ModelMount(f"file://{MODEL_MOUNT}", [volume], [read_only_mount], needs_fetch=True)
    return ModelMount(model.uri, [], [], needs_fetch=False)


def draft_location(spec: api.ModelDeploymentSpec) -> ModelMount | None:
    """Where the pod holds spec.serving.speculative's draft model, if it names one: its own
    emptyDir, filled by its own init container (fetch_container with `draft`)."""
    if api.draft_source(spec) is None:
        return None
    volume = {"name": DRAFT_VOLUME, "emptyDir": {}}
    mount = {"name": DRAFT_VOLUME, "mountPath": DRAFT_MOUNT, "readOnly": True}
    return ModelMount(DRAFT_MOUNT, [volume], [mount], needs_fetch=True)


def kv_disk_volume(offload: api.KvOffload | None) -> dict[str, Any] | None:
    """The disk tier's volume: the claim or hostPath the spec names, else an emptyDir sized to
    the tier (so the kubelet evicts a pod whose tier outgrew it rather than fill the node)."""
    disk = None if offload is None else offload.disk
    if disk is None:
        return None
    if disk.claim_name is not None:
        return {"name": KV_DISK_VOLUME, "persistentVolumeClaim": {"claimName": disk.claim_name}}
    if disk.host_path is not None:
        return {
            "name": KV_DISK_VOLUME,
            "hostPath": {"path": disk.host_path, "type": "DirectoryOrCreate"},
        }
    limit = quantity(math.ceil(disk.size_gi_b * KV_DISK_HEADROOM * GIB / MIB) * MIB)
    return {"name": KV_DISK_VOLUME, "emptyDir": {"sizeLimit": limit}}


def quantity(num_bytes: int) -> str:
    """Bytes as a Kubernetes quantity in the largest binary unit that holds them whole."""
    for suffix, size in (("Ti", 2**40), ("Gi", GIB), ("Mi", MIB), ("Ki", 2**10)):
        if num_bytes % size == 0:
            return f"{num_bytes // size}{suffix}"
    return str(num_bytes)


def adapter_claims(spec: api.ModelDeploymentSpec) -> list[str]:
    """The claims pvc:// adapters name, sorted: each mounted read-only at LORA_CLAIMS_MOUNT/CLAIM
    (a claim new to the spec changes the template, so it rolls the pods; its adapters do not)."""
    sources = (parse_model_uri(a.uri) for a in spec.adapters)
    return sorted({s.location for s in sources if s.scheme == "pvc"})


def adapter_claim_volumes(
    spec: api.ModelDeploymentSpec,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pvc:// adapters' claims as the pod's volumes and the runtime's read-only mounts."""
    claims = adapter_claims(spec)
    volumes = [
        {"name": f"lora-claim-{i}", "persistentVolumeClaim": {"claimName": c, "readOnly": True}}
        for i, c in enumerate(claims)
    ]
    mounts = [
        {"name": f"lora-claim-{i}", "mountPath": f"{LORA_CLAIMS_MOUNT}/{c}", "readOnly": True}
        for i, c in enumerate(claims)
    ]
    return volumes, mounts
