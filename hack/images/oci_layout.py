"""An image's OCI layout on disk: its config (the spec's run settings, the layers, the labels),
written with the manifest and index.json next to the cached layers' blobs, and read back (the
manifest, a blob, the recipe label `--if-changed` compares). Read by the podrunner and the tests.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hack.images import layers
from hack.images.checkout import version
from hack.images.layer_cache import LayerCache
from hack.images.recipe import RECIPE_LABEL, tree_recipe_digest
from hack.images.spec import ImageSpec


def config_labels(spec: ImageSpec, source: str) -> dict[str, str]:
    return {
        "org.opencontainers.image.version": version(),
        "org.opencontainers.image.revision": source,
        RECIPE_LABEL: tree_recipe_digest(spec),
    }


def spec_config(
    spec: ImageSpec, created: str, source: str, stack: list[layers.Layer]
) -> dict[str, Any]:
    """The image config of `spec` on the layers `stack`."""
    return layers.image_config(
        created=created, user=spec.user, entrypoint=spec.entrypoint, cmd=spec.cmd,
        env=spec.env_list(), exposed_ports=spec.exposed_ports, volumes=spec.volumes,
        labels=config_labels(spec, source), layers=stack,
    )  # fmt: skip


def write_layout(
    layout: Path, cache: LayerCache, config: dict[str, Any], stack: list[layers.Layer]
) -> None:
    """An OCI layout of the layers' cached blobs (hard links: the blobs are immutable, named by
    digest), the config, the manifest and index.json tagged with the version."""
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    for layer in stack:
        target = blobs / layer.digest.removeprefix("sha256:")
        try:
            os.link(cache.blob(layer.digest), target)
        except OSError:  # another filesystem
            shutil.copyfile(cache.blob(layer.digest), target)
    config_bytes = layers.canonical_json(config)
    manifest_bytes = layers.canonical_json(layers.manifest_json(config_bytes, stack))
    for data in (config_bytes, manifest_bytes):
        (blobs / layers.sha256_digest(data).removeprefix("sha256:")).write_bytes(data)
    index = layers.index_json(manifest_bytes, version())
    (layout / "index.json").write_bytes(layers.canonical_json(index))
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')


def blob(layout: Path, digest: object) -> Path:
    return layout / "blobs" / "sha256" / str(digest).removeprefix("sha256:")


def manifest(layout: Path) -> tuple[str, dict[str, Any]]:
    """The layout's (only) manifest: its digest and its parsed JSON."""
    index = json.loads((layout / "index.json").read_text())
    digest = str(index["manifests"][0]["digest"])
    return digest, json.loads(blob(layout, digest).read_text())


def layer_digests(layouts: Iterable[Path]) -> set[str]:
    """The digests of the layers the layouts' manifests name."""
    return {str(layer["digest"]) for layout in layouts for layer in manifest(layout)[1]["layers"]}


def summary(layout: Path) -> str:
    digest, parsed = manifest(layout)
    stack = parsed["layers"]
    size = sum(int(layer["size"]) for layer in stack)
    return f"{layout.name}: {digest}, {len(stack)} layer(s), {size / 1e6:.1f} MB compressed"


def cached_recipe_digest(layout: Path) -> str | None:
    """The recipe label of the layout's image config; None when there is no layout or label."""
    if not (layout / "index.json").is_file():
        return None
    _, parsed = manifest(layout)
    config = json.loads(blob(layout, parsed["config"]["digest"]).read_text())
    labels = config.get("config", {}).get("Labels") or {}
    return labels.get(RECIPE_LABEL)
