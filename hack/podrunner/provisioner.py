"""The dev cluster's storage: a dynamic provisioner of local directories, as rancher's
local-path-provisioner is on kind.

Without one a PersistentVolumeClaim stays Pending and the scheduler never places its pods. This
one serves the default StorageClass `kvpilot-local`: each Pending claim of that class gets a
hostPath PersistentVolume on the pod runner's claims directory (the directory the runner already
mounts for that claim), which kube-controller-manager's binder then binds; a Released volume is
deleted with its directory (reclaim policy Delete).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

STORAGE_CLASS = "kvpilot-local"
PROVISIONER = "kvpilot.dev/local-path"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"


def storage_class() -> dict[str, Any]:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {
            "name": STORAGE_CLASS,
            "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
        },
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }


def claim_dir(claims_dir: Path, namespace: str, claim: str) -> Path:
    """Where a claim's data lives: the same directory whichever pod mounts it (pods.volume_dirs)."""
    return claims_dir / namespace / claim


def wants_volume(claim: dict[str, Any]) -> bool:
    spec, status = claim["spec"], claim.get("status") or {}
    return (
        spec.get("storageClassName") == STORAGE_CLASS
        and not spec.get("volumeName")
        and status.get("phase", "Pending") == "Pending"
        and not claim["metadata"].get("deletionTimestamp")
    )


def volume_for(claim: dict[str, Any], claims_dir: Path) -> dict[str, Any]:
    meta = claim["metadata"]
    path = claim_dir(claims_dir, meta["namespace"], meta["name"])
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"pvc-{meta['uid']}", "annotations": {PROVISIONED_BY: PROVISIONER}},
        "spec": {
            "capacity": {"storage": claim["spec"]["resources"]["requests"]["storage"]},
            "accessModes": list(claim["spec"]["accessModes"]),
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": STORAGE_CLASS,
            "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
        },
    }


def is_released_here(volume: dict[str, Any]) -> bool:
    annotations = volume["metadata"].get("annotations") or {}
    return (
        annotations.get(PROVISIONED_BY) == PROVISIONER
        and (volume.get("status") or {}).get("phase") == "Released"
    )


class Provisioner:
    def __init__(self, api: client.ApiClient, claims_dir: Path) -> None:
        self.core = client.CoreV1Api(api)
        self.storage = client.StorageV1Api(api)
        self.claims_dir = claims_dir
        self.has_class = False

    def tick(self) -> None:
        if not self.has_class:
            self.ensure_storage_class()
        for claim in self.core.list_persistent_volume_claim_for_all_namespaces().items:
            doc = self.core.api_client.sanitize_for_serialization(claim)
            if wants_volume(doc):
                self.create_volume(doc)
        for volume in self.core.list_persistent_volume().items:
            doc = self.core.api_client.sanitize_for_serialization(volume)
            if is_released_here(doc):
                self.delete_volume(doc)

    def ensure_storage_class(self) -> None:
        try:
            self.storage.create_storage_class(storage_class())  # type: ignore[arg-type]
        except ApiException as err:
            if err.status != 409:
                raise
        self.has_class = True

    def create_volume(self, claim: dict[str, Any]) -> None:
        volume = volume_for(claim, self.claims_dir)
        Path(volume["spec"]["hostPath"]["path"]).mkdir(parents=True, exist_ok=True)
        try:
            self.core.create_persistent_volume(volume)  # type: ignore[arg-type]
        except ApiException as err:
            if err.status != 409:  # made on an earlier tick; the binder has not caught up yet
                raise

    def delete_volume(self, volume: dict[str, Any]) -> None:
        shutil.rmtree(volume["spec"]["hostPath"]["path"], ignore_errors=True)
        try:
            self.core.delete_persistent_volume(volume["metadata"]["name"])
        except ApiException as err:
            if err.status != 404:
                raise
