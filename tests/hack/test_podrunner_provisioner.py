"""The dev cluster's local-path provisioner: which claims get a volume, and what volume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hack.podrunner import pods, provisioner


def claim(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "metadata": {"name": "cache", "namespace": "team", "uid": "u-1"},
        "spec": {
            "storageClassName": provisioner.STORAGE_CLASS,
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": "2Gi"}},
        },
        "status": {"phase": "Pending"},
    }
    for key, value in changes.items():
        section, name = key.split("__")
        doc[section][name] = value
    return doc


@pytest.mark.parametrize(
    ("doc", "wanted"),
    [
        (claim(), True),
        (claim(spec__storageClassName="gp3"), False),  # another provisioner's class
        (claim(spec__volumeName="pv-1"), False),  # already bound
        (claim(status__phase="Bound"), False),
        (claim(metadata__deletionTimestamp="2026-01-01T00:00:00Z"), False),
    ],
)
def test_which_claims_get_a_volume(doc: dict[str, Any], wanted: bool) -> None:
    assert provisioner.wants_volume(doc) is wanted


def test_the_volume_is_the_directory_the_runner_mounts_for_the_claim(tmp_path: Path) -> None:
    volume = provisioner.volume_for(claim(), tmp_path)
    pod = {
        "metadata": {"namespace": "team"},
        "spec": {"volumes": [{"name": "m", "persistentVolumeClaim": {"claimName": "cache"}}]},
    }
    mounted = pods.volume_dirs(pod, tmp_path / "pod", tmp_path)["m"]
    assert volume["spec"]["hostPath"]["path"] == str(mounted)
    assert volume["spec"]["claimRef"]["uid"] == "u-1"
    assert volume["spec"]["capacity"] == {"storage": "2Gi"}
    assert volume["spec"]["accessModes"] == ["ReadWriteMany"]
    assert volume["metadata"]["name"] == "pvc-u-1"


@pytest.mark.parametrize(
    ("annotations", "phase", "deleted"),
    [
        ({provisioner.PROVISIONED_BY: provisioner.PROVISIONER}, "Released", True),
        ({provisioner.PROVISIONED_BY: provisioner.PROVISIONER}, "Bound", False),
        ({}, "Released", False),  # someone else's volume is not ours to delete
    ],
)
def test_released_volumes_of_this_provisioner_are_deleted(
    annotations: dict[str, str], phase: str, deleted: bool
) -> None:
    volume = {"metadata": {"name": "pv", "annotations": annotations}, "status": {"phase": phase}}
    assert provisioner.is_released_here(volume) is deleted
