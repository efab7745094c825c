"""The OCI layouts `make images` builds (hack/images), read and run for the packaging tests.

Images are run the way a container runtime would, without one: the layout unpacked by umoci, then
the config's entrypoint started under `unshare` (its own mount and PID namespaces, so the
entrypoint is PID 1 and every mount goes when it exits) and `chroot` as the config's user, with
the config's Env and nothing of the host's.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hack.images import checkout, oci_layout
from hack.images.spec import ImageSpec


@dataclass(frozen=True)
class Image:
    layout: Path
    tag: str
    manifest_digest: str
    manifest: dict[str, Any]
    config: dict[str, Any]

    @property
    def layers(self) -> list[dict[str, Any]]:
        return list(self.manifest["layers"])

    @property
    def run_config(self) -> dict[str, Any]:
        return dict(self.config["config"])

    def compressed_size(self) -> int:
        return sum(int(str(layer["size"])) for layer in self.layers)

    def members(self) -> Iterator[tarfile.TarInfo]:
        """Every entry of every layer, read as a stream (the runtime's layer is GBs)."""
        for layer in self.layers:
            with tarfile.open(
                oci_layout.blob(self.layout, layer["digest"]), mode="r|gz"
            ) as archive:
                yield from archive


def read(layout: Path) -> Image:
    index = json.loads((layout / "index.json").read_text())
    (entry,) = index["manifests"]
    digest, manifest = oci_layout.manifest(layout)
    config_digest = manifest["config"]["digest"]
    config = json.loads(oci_layout.blob(layout, config_digest).read_text())
    tag = entry["annotations"]["org.opencontainers.image.ref.name"]
    return Image(layout, tag, digest, manifest, config)


def cached(spec: ImageSpec) -> Image:
    """The image `make images` left in the build cache, or a skip that says how to build it."""
    layout = checkout.layout_dir(spec)
    if not (layout / "index.json").is_file():
        pytest.skip(f"no {spec.name} image at {layout}: build it with `make images` (as root)")
    return read(layout)


def require_root_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("running an image's filesystem needs root (umoci unpack, unshare, chroot)")
    for tool in ("umoci", "unshare", "chroot"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed: `make system-deps` (as root)")


def unpack(image: Image, bundle: Path) -> Path:
    """The image's root filesystem under `bundle` (umoci unpack); returns the rootfs path."""
    subprocess.run(
        ["umoci", "unpack", "--image", f"{image.layout}:{image.tag}", str(bundle)],
        check=True, capture_output=True,
    )  # fmt: skip
    return bundle / "rootfs"


def command(
    image: Image,
    rootfs: Path,
    args: list[str],
    binds: dict[Path, str] | None = None,
    entrypoint: list[str] | None = None,
) -> list[str]:
    """The argv that starts the image's entrypoint (or `entrypoint`) with `args` (for its Cmd) in
    `rootfs` as its user: /proc and /dev mounted, `binds` (host path -> path in the image)
    bind-mounted, in new mount and PID namespaces on the host's network."""
    run_config = image.run_config
    if entrypoint is None:
        entrypoint = [str(part) for part in run_config["Entrypoint"]]
    env = [str(entry) for entry in run_config["Env"]]
    # mount points made as a container runtime makes them (the image ships no /dev)
    mounts = [f"mkdir -p {rootfs}/proc {rootfs}/dev", f"mount -t proc proc {rootfs}/proc",
              f"mount --rbind /dev {rootfs}/dev"]  # fmt: skip
    for source, target in (binds or {}).items():
        mounts.append(f"mkdir -p {rootfs}{target} && mount --bind {source} {rootfs}{target}")
    start = shlex.join(
        ["chroot", f"--userspec={run_config['User']}", str(rootfs),
         "/usr/bin/env", "-i", "HOME=/tmp", *env, *entrypoint, *args]
    )  # fmt: skip
    script = " && ".join([*mounts, f"exec {start}"])
    return ["unshare", "--mount", "--pid", "--fork", "sh", "-c", script]
