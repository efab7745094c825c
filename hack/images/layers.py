"""The layers of a daemonless image and the OCI documents that name them: pure logic, no I/O.

An image is a stack of layers, each cached under its own key (`layer_key`): the bytes that decide
the layer's content and the digest of the layer below. A change to kvpilot's sources moves only
the top layer's key, so a rebuild repacks that layer and reuses the others' blobs, as Docker's
layer cache does for an unchanged `RUN`/`COPY` prefix. hack/images/build.py makes the layers and
writes the layout from `image_config`, `manifest_json` and `index_json`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Bumped when the way a layer is packed changes (tar flags, compression): every key moves.
PACKING = b"tar:gnu-pax-sorted-numeric-owner-clamped-mtime;gzip:zlib-6-mtime-0"
LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
REF_NAME = "org.opencontainers.image.ref.name"


@dataclass(frozen=True)
class Layer:
    """A packed layer: its gzip blob's digest and size, and the digest of its tar (diff_id)."""

    name: str  # base, venv, kernels, app
    digest: str
    diff_id: str
    size: int
    created_by: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.digest, "diff_id": self.diff_id,
                "size": self.size, "created_by": self.created_by}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Layer:
        return cls(str(data["name"]), str(data["digest"]), str(data["diff_id"]),
                   int(data["size"]), str(data["created_by"]))  # fmt: skip


def framed_digest(files: Mapping[str, bytes]) -> str:
    """SHA-256 over named inputs, by name (sorted), each name and its length framed: no two
    different sets of inputs hash alike by moving bytes from one to another."""
    digest = hashlib.sha256()
    for name in sorted(files):
        content = files[name]
        digest.update(f"{name}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()


def layer_key(name: str, inputs: Mapping[str, bytes], below: str | None, epoch: int) -> str:
    """The cache key of layer `name`: its own inputs, the digest of the layer it is built on
    (None for the base), the packing and the timestamp its files are clamped to."""
    framed = {f"input:{key}": value for key, value in inputs.items()}
    framed["layer"] = name.encode()
    framed["below"] = (below or "").encode()
    framed["packing"] = PACKING
    framed["epoch"] = str(epoch).encode()
    return f"{name}-{framed_digest(framed)[:32]}"


def canonical_json(document: Mapping[str, Any]) -> bytes:
    """Sorted keys, no spaces: the same document is the same bytes, hence the same digest."""
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def image_config(
    *,
    created: str,
    user: str,
    entrypoint: Sequence[str],
    cmd: Sequence[str],
    env: Sequence[str],
    exposed_ports: Sequence[int],
    volumes: Sequence[str],
    labels: Mapping[str, str],
    layers: Sequence[Layer],
) -> dict[str, Any]:
    """The OCI image config: the run settings, one history entry per layer, the diff_ids."""
    run: dict[str, Any] = {
        "User": user,
        "Entrypoint": list(entrypoint),
        "Cmd": list(cmd),
        "Env": list(env),
        "ExposedPorts": {f"{port}/tcp": {} for port in exposed_ports},
        "Labels": dict(labels),
    }
    if volumes:
        run["Volumes"] = {volume: {} for volume in volumes}
    return {
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        "config": run,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created": created, "created_by": layer.created_by} for layer in layers],
    }


def descriptor(media_type: str, data: bytes) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": sha256_digest(data), "size": len(data)}


def layer_descriptor(layer: Layer) -> dict[str, Any]:
    return {"mediaType": LAYER_MEDIA_TYPE, "digest": layer.digest, "size": layer.size}


def manifest_json(config: bytes, layers: Sequence[Layer]) -> dict[str, Any]:
    return {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": descriptor(CONFIG_MEDIA_TYPE, config),
        "layers": [layer_descriptor(layer) for layer in layers],
    }


def index_json(manifest: bytes, tag: str) -> dict[str, Any]:
    entry = {**descriptor(MANIFEST_MEDIA_TYPE, manifest), "annotations": {REF_NAME: tag}}
    return {"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "manifests": [entry]}
