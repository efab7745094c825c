"""The images mode's image store: the OCI layouts `make images` cached, each unpacked once per
manifest digest (its layers applied with GNU tar) and then only read, by every pod that runs it.

Unpacking the runtime image takes a minute or more, so it runs on a thread of its own: the pod
runner's loop (heartbeats, probes) never waits for it; a pod whose image is being unpacked waits
in ContainerCreating, as one whose image is being pulled does.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hack.images import checkout, oci_layout
from hack.podrunner import images
from hack.podrunner.images import ImageRef

UNPACKED_MARK = "kvpilot-unpacked"  # written last: a directory without it is incomplete
LAYER_TYPES = (
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
)


@dataclass(frozen=True)
class Unpacked:
    rootfs: Path
    config: dict[str, Any]  # the image config's `config` (User, Entrypoint, Cmd, Env, ...)
    passwd: str
    group: str

    def as_image(self) -> dict[str, Any]:
        return {"config": self.config, "passwd": self.passwd, "group": self.group}


class ImagePullError(ValueError):
    """The pod's image cannot be had (ErrImagePull); the message says what to do."""


class ImageNotReadyError(Exception):
    """The image is being unpacked: the pod waits (ContainerCreating)."""


class ImageStore:
    def __init__(self, images_dir: Path, unpack_dir: Path) -> None:
        self.images_dir = images_dir  # <images_dir>/<tag>/<name>: make images' layouts
        self.unpack_dir = unpack_dir  # <unpack_dir>/<manifest digest hex>/rootfs
        self.lock = threading.Lock()
        self.pending: dict[str, Future[Path]] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unpack")

    def layout(self, ref: ImageRef) -> Path:
        return self.images_dir / ref.tag / ref.name

    def get(self, ref: ImageRef, reference: str) -> Unpacked:
        """The unpacked image; ImagePullError (with what to do) when it is not cached or not the
        digest the pod pins; ImageNotReadyError while it is unpacked."""
        layout = self.layout(ref)
        if not (layout / "index.json").is_file():
            raise ImagePullError(
                f"image {reference} is not in the build cache (no OCI layout at {layout}):"
                f" {images.pull_hint(ref, checkout.version())}"
            )
        digest, manifest = oci_layout.manifest(layout)
        if ref.digest is not None and ref.digest != digest:
            raise ImagePullError(
                f"image {reference}: the cached {ref.name}:{ref.tag} is {digest}, not the digest"
                " the pod names: rebuild it with `make images`, or name the cached digest"
            )
        bundle = self.unpack_dir / digest.removeprefix("sha256:")
        if not (bundle / UNPACKED_MARK).is_file():
            self.unpack_later(layout, ref, bundle)
        config = json.loads(oci_layout.blob(layout, manifest["config"]["digest"]).read_text())
        rootfs = bundle / "rootfs"
        etc = rootfs / "etc"
        return Unpacked(rootfs, dict(config.get("config") or {}), _read(etc / "passwd"),
                        _read(etc / "group"))  # fmt: skip

    def unpack_later(self, layout: Path, ref: ImageRef, bundle: Path) -> None:
        key = str(bundle)
        with self.lock:
            future = self.pending.get(key)
            if future is None:
                future = self.pending[key] = self.pool.submit(unpack, layout, ref.tag, bundle)
        if not future.done():
            raise ImageNotReadyError(f"unpacking {ref.name}:{ref.tag} into {bundle}")
        with self.lock:
            self.pending.pop(key, None)
        try:
            future.result()
        except subprocess.CalledProcessError as err:  # tried again at the pod's next start
            raise ImagePullError(
                f"unpacking {layout} failed: {err.stderr.decode(errors='replace')[-500:]}"
            ) from err

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def unpack(layout: Path, tag: str, bundle: Path) -> Path:
    """The image's layers into `bundle`/rootfs, staged beside it and renamed into place once
    complete (a lock keeps two runners from unpacking the same digest at once)."""
    bundle.parent.mkdir(parents=True, exist_ok=True)
    with (bundle.parent / f".{bundle.name}.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        if (bundle / UNPACKED_MARK).is_file():
            return bundle
        shutil.rmtree(bundle, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=bundle.parent, prefix=f".{bundle.name}-") as tmp:
            staged = Path(tmp) / "bundle"
            apply_layers(layout, staged / "rootfs")
            (staged / UNPACKED_MARK).write_text(f"{layout}:{tag}\n")
            staged.rename(bundle)
    return bundle


def apply_layers(layout: Path, rootfs: Path) -> None:
    """Each layer in order, as the OCI image spec applies them: its whiteouts delete what the
    layers below hold, then its files are extracted (owners kept). GNU tar, not `umoci unpack`:
    umoci also hashes every file into an mtree, for a repack the runner never does."""
    _, manifest = oci_layout.manifest(layout)
    rootfs.mkdir(parents=True)
    for index, layer in enumerate(manifest["layers"]):
        media_type = str(layer["mediaType"])
        if media_type not in LAYER_TYPES:
            raise ImagePullError(f"{layout}: layer media type {media_type} is not supported")
        blob = oci_layout.blob(layout, layer["digest"])
        if index > 0:  # nothing lies below the first layer: no need to read it twice
            listed = subprocess.run(["tar", "-tf", str(blob)], check=True, capture_output=True)
            apply_whiteouts(rootfs, images.whiteouts(listed.stdout.decode().splitlines()))
        subprocess.run(
            ["tar", "-xpf", str(blob), "-C", str(rootfs), "--numeric-owner", "--same-owner",
             "--exclude=.wh.*"],
            check=True, capture_output=True,
        )  # fmt: skip


def apply_whiteouts(rootfs: Path, found: images.Whiteouts) -> None:
    for opaque in found.opaque_dirs:
        folder = rootfs / opaque
        for child in folder.iterdir() if folder.is_dir() and not folder.is_symlink() else ():
            remove(child)
    for path in found.removed:
        remove(rootfs / path)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
