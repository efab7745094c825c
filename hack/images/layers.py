"""The layers of a daemonless image, the commands that make them and the OCI documents that name
them: pure logic, no I/O.

An image is a stack of layers, each cached under its own key (`layer_key`): the bytes that decide
the layer's content and the digest of the layer below. A change to kvpilot's sources moves only
the top layer's key, so a rebuild repacks that layer and reuses the others' blobs, as Docker's
layer cache does for an unchanged `RUN`/`COPY` prefix. The argv of the tools that make and pack a
layer (mmdebstrap, tar) are built here too, since the base layer's key holds mmdebstrap's;
hack/images/builders.py runs them, and hack/images/oci_layout.py writes the layout from
`image_config`, `manifest_json` and `index_json`.
"""

from __future__ import annotations

import datetime
import fnmatch
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hack.images import spec as specs
from hack.images.spec import ImageSpec

# Bumped when the way a layer is packed changes (tar flags, compression): every key moves.
PACKING = b"tar:gnu-pax-sorted-numeric-owner-clamped-mtime;gzip:zlib-6-mtime-0"
LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
REF_NAME = "org.opencontainers.image.ref.name"
# The steps customize.sh runs in an image's root filesystem (the user, the venv, the app)
HOOK = Path(__file__).with_name("customize.sh")
# The venv step's byte-compiler (its .pyc bytes depend on each file alone)
COMPILE_PYC = HOOK.with_name("compile_pyc.py")
# Each layer's entry in the image config's history
CREATED_BY = {
    "base": "mmdebstrap --variant=essential of the spec's Debian packages; the user (hack/images)",
    "venv": "uv venv; uv pip sync --require-hashes of uv.lock's pins (hack/images)",
    "kernels": "paged_kernel --portable, each level (hack/images)",
    "app": "uv pip install --no-deps of the kvpilot wheel (hack/images)",
}


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


def rfc3339(epoch: int) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- the commands that make and pack a layer -------------------------------------------------


def apt_sources(spec: ImageSpec) -> list[str]:
    suites = [f"deb {specs.DEBIAN_MIRROR} {suite} main" for suite in spec.debian_suites]
    security = f"deb {specs.DEBIAN_SECURITY_MIRROR} {spec.debian_release}-security main"
    return [*suites, security]


def mmdebstrap_command(
    spec: ImageSpec, tree: Path, apt_cache: Path, hook: Path = HOOK
) -> list[str]:
    """The base layer's root filesystem as a directory: essential packages (no apt, no
    compilers) plus the spec's, documentation left out, the user added by customize.sh."""
    return _mmdebstrap(spec, spec.debian_packages, tree, apt_cache, hook)


def kernel_stage_command(
    spec: ImageSpec, root: Path, apt_cache: Path, hook: Path = HOOK
) -> list[str]:
    """The build stage of a spec with kernel_build_packages: the base's packages plus a compiler
    and torch's headers, as a directory the venv is installed in and the kernels are built in
    (build_stage_kernels); it never becomes a layer."""
    packages = (*spec.debian_packages, *spec.kernel_build_packages)
    return _mmdebstrap(spec, packages, root, apt_cache, hook)


def _mmdebstrap(
    spec: ImageSpec, packages: tuple[str, ...], out: Path, apt_cache: Path, hook: Path
) -> list[str]:
    dpkg = [f"--dpkgopt=path-exclude={path}" for path in specs.DPKG_PATH_EXCLUDES]
    dpkg += [f"--dpkgopt=path-include={path}" for path in specs.DPKG_PATH_INCLUDES]
    archives = '"$1/var/cache/apt/archives"'
    return [
        "mmdebstrap",
        "--mode=root",
        "--variant=essential",
        "--format=directory",
        f"--include={','.join(packages)}",
        *dpkg,
        # The .debs of earlier builds (apt_cache, bind-mounted over apt's archive directory):
        # kept, not unlinked after the essential step, and unmounted before mmdebstrap's cleanup,
        # so a rebuild downloads nothing it already has and no .deb stays in the image.
        "--skip=download/empty",
        "--skip=essential/unlink",
        f"--setup-hook=mkdir -p {archives} && mount --bind {apt_cache} {archives}",
        f"--customize-hook=umount {archives}",
        f'--customize-hook=bash {hook} user "$1"',
        spec.debian_release,
        str(out),
        *apt_sources(spec),
    ]


def not_installed_names(spec: ImageSpec, locked_names: list[str]) -> list[str]:
    """uv.lock's package names that the spec's not_installed patterns leave out, sorted."""
    patterns = spec.not_installed
    return sorted(n for n in set(locked_names) if any(fnmatch.fnmatchcase(n, p) for p in patterns))


def tar_command(tree: Path, epoch: int, excludes: tuple[str, ...] = ()) -> list[str]:
    """A reproducible tar of `tree` on stdout, as mmdebstrap packs one: sorted names, numeric
    owners, mtimes clamped to `epoch`, no atime/ctime, file capabilities kept and overlayfs'
    own attributes (trusted.overlay.*) left out."""
    return [
        "tar", "--create", "--file=-", f"--directory={tree}", "--sort=name", "--format=pax",
        "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
        f"--mtime=@{epoch}", "--clamp-mtime", "--numeric-owner", "--one-file-system",
        "--xattrs", "--xattrs-exclude=trusted.*", *[f"--exclude={path}" for path in excludes],
        ".",
    ]  # fmt: skip
