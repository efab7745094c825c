"""`make images`: the OCI images of hack/images/spec.py, built without a container engine.

    python -m hack.images [kvpilot-operator] [kvpilot-runtime] [kvpilot-runtime-cpu] [--out DIR]

Per image, a stack of layers, each cached under a key of its own inputs (hack/images/layers.py)
in ${KVPILOT_IMAGE_LAYER_CACHE:-<build cache>/layers} and rebuilt only when that key moves:
  base     mmdebstrap of Debian (essential variant plus the spec's packages) and the non-root user;
           the .debs stay in the cache's apt/<release> for the next base, not in the image
  venv     the locked virtualenv, installed from uv.lock by uv running inside the base (chroot on
           an overlay: the overlay's upper directory is the layer)
  kernels  the paged-attention kernels (runtimes), built by the image's torch
  app      the kvpilot wheel, into that venv: the only layer a source change rebuilds
Each layer is a reproducible tar (sorted entries, numeric owners, mtimes clamped to a timestamp
of its own inputs; no device nodes), gzip'd without a name or time; the OCI layout's config,
manifest and index are written here as canonical JSON. The same commit, uv.lock and Debian archive
state give the same manifest digest, from a warm cache or a cold one. `--refresh` rebuilds every
layer (the base from today's archive: security updates). Needs root (mmdebstrap --mode=root,
chroot, overlayfs, a bind mount of uv's cache).
Layouts land under ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/images/<version>/<image>, tag <version>.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import fnmatch
import functools
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import tomllib
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hack.images import layers
from hack.images import spec as specs
from hack.images.spec import ImageSpec

ROOT = Path(__file__).resolve().parents[2]
HOOK = Path(__file__).with_name("customize.sh")
TOOLS = ("mmdebstrap", "umoci")
# What an image is built from, besides the Debian archive: a change here is a new image.
INPUTS = (
    "pyproject.toml", "uv.lock", "README.md", "contract", "operator/kvpilot", "runtime/kvpilot",
    "gateway/kvpilot", "hack/images", "hack/uv-requirements.txt",
)  # fmt: skip


def cache_dir() -> Path:
    return Path(os.environ.get("KVPILOT_CACHE_DIR") or Path.home() / ".cache" / "kvpilot")


def version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def layout_dir(spec: ImageSpec, out: Path | None = None) -> Path:
    return (out or cache_dir() / "images" / version()) / spec.name


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH when set, else the commit time of HEAD: a rebuild of one commit gets the
    same timestamps (a dirty tree does too: the digest then differs by content alone)."""
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return int(os.environ["SOURCE_DATE_EPOCH"])
    out = subprocess.run(
        ["git", "log", "-1", "--format=%ct"], cwd=ROOT, check=True, capture_output=True, text=True
    )
    return int(out.stdout.strip())


def rfc3339(epoch: int) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


def lock_package_names() -> list[str]:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    return [str(package["name"]) for package in lock.get("package", [])]


def export_args(spec: ImageSpec) -> list[str]:
    """`uv export` of the spec's extras' pins, less what it does not install."""
    extras = [arg for extra in spec.extras for arg in ("--extra", extra)]
    names = not_installed_names(spec, lock_package_names()) if spec.not_installed else []
    omitted = [arg for name in names for arg in ("--no-emit-package", name)]
    return ["export", "--frozen", "--quiet", "--no-emit-project", *extras, *omitted]


# How an image is made, apart from kvpilot's own sources: a change to any of these is what CI
# rebuilds the image for (`--if-changed`), so the build itself is exercised at least once per
# change to a Dockerfile, the image's locked requirements or this recipe. The requirements are
# the image's own (its extras' pins, as `uv export` gives them): a dev dependency added to
# uv.lock is not a new image.
RECIPE = (
    "operator/Dockerfile", "runtime/Dockerfile", "runtime/Dockerfile.cpu", ".python-version",
    "hack/uv-requirements.txt", "hack/images/build.py", "hack/images/spec.py",
    "hack/images/customize.sh", "hack/images/layers.py",
)  # fmt: skip
RECIPE_LABEL = "dev.kvpilot.image.recipe"


def tree_recipe_digest(spec: ImageSpec) -> str:
    return _tree_recipe_digest(spec.name)


@functools.cache  # by name: a spec holds a dict, so it is not hashable
def _tree_recipe_digest(name: str) -> str:
    files = {path: (ROOT / path).read_bytes() for path in RECIPE}
    files["requirements.txt"] = locked_requirements(specs.IMAGES[name]).encode()
    return layers.framed_digest(files)


def locked_requirements(spec: ImageSpec) -> str:
    """The spec's extras' pins from uv.lock, with hashes, as the image installs them."""
    argv = ["bash", str(ROOT / "hack" / "uv.sh"), *export_args(spec), "--no-header"]
    return subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True).stdout


def cached_recipe_digest(layout: Path) -> str | None:
    """The recipe label of the layout's image config; None when there is no layout or label."""
    if not (layout / "index.json").is_file():
        return None
    _, parsed = manifest(layout)
    config = json.loads(blob(layout, parsed["config"]["digest"]).read_text())
    labels = config.get("config", {}).get("Labels") or {}
    return labels.get(RECIPE_LABEL)


def revision() -> str:
    """HEAD's commit, with `-dirty` when the files an image is built from have changes."""
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    status = subprocess.run(
        ["git", "status", "--porcelain", "--", *INPUTS], cwd=ROOT, check=True, capture_output=True,
        text=True,
    ).stdout  # fmt: skip
    return f"{head}-dirty" if status.strip() else head


def uv_binary() -> Path:
    """The project's pinned uv (hack/uv.sh installs it on first use); copied into the root
    filesystem for the install and removed before packing."""
    subprocess.run(["bash", str(ROOT / "hack" / "uv.sh"), "--version"], check=True)
    pins = (ROOT / "hack" / "uv-requirements.txt").read_bytes()
    return cache_dir() / "tools" / f"uv-{hashlib.sha256(pins).hexdigest()[:16]}" / "bin" / "uv"


def uv(*args: str, env: Mapping[str, str] | None = None) -> None:
    subprocess.run(["bash", str(ROOT / "hack" / "uv.sh"), *args], cwd=ROOT, check=True, env=env)


def build_kernel(
    python: list[str], level: str, out: Path, seen_as: str | None = None, cwd: Path | None = None
) -> None:
    """The paged-attention kernel for one portable level, built by `python`'s torch: this venv's
    (uv.lock's, the image's too, on the image's Debian release) or the build stage's (chrooted:
    it sees `out` as `seen_as`), one process per level; only the library and its mark go into
    the image."""
    argv = [*python, "-m", "kvpilot.runtime.layers.paged_kernel", "--portable", level,
            "--out", seen_as or str(out)]  # fmt: skip
    subprocess.run(argv, check=True, cwd=cwd)
    for built in out.iterdir() if out.is_dir() else ():
        keep = {"built", (built / "built").read_text().strip()}
        for path in built.iterdir():
            if path.name not in keep:
                shutil.rmtree(path) if path.is_dir() else path.unlink()


# ---- layers ----------------------------------------------------------------------------------

# The files each cached layer is made from, besides what its key names directly: the last commit
# that touched them gives the layer's timestamp (layer_epoch), so a rebuild of the same inputs
# from a cold cache packs the same bytes as the warm cache holds.
BASE_FILES = ("hack/images/spec.py", "hack/images/customize.sh")
VENV_FILES = (*BASE_FILES, "uv.lock", "pyproject.toml", "hack/uv-requirements.txt")
KERNEL_SOURCES = (
    "runtime/kvpilot/runtime/layers/paged_kernel.py",
    "runtime/kvpilot/runtime/layers/paged_decode.cpp",
)
KERNEL_FILES = (*VENV_FILES, *KERNEL_SOURCES)
LAYER_CACHE_ENV = "KVPILOT_IMAGE_LAYER_CACHE"
# Nothing below /dev ships (the container runtime makes it; nodes in a layer break rootless).
BASE_EXCLUDES = ("./dev/*",)
CREATED_BY = {
    "base": "mmdebstrap --variant=essential of the spec's Debian packages; the user (hack/images)",
    "venv": "uv venv; uv pip sync --require-hashes of uv.lock's pins (hack/images)",
    "kernels": "paged_kernel --portable, each level (hack/images)",
    "app": "uv pip install --no-deps of the kvpilot wheel (hack/images)",
}


def layer_cache_dir() -> Path:
    return Path(os.environ.get(LAYER_CACHE_ENV) or cache_dir() / "layers")


def layer_epoch(paths: tuple[str, ...]) -> int:
    """SOURCE_DATE_EPOCH when set, else the commit time of the last commit that touched
    `paths`: a layer's timestamps follow its own inputs, not HEAD, or every commit would move
    every layer's bytes."""
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return int(os.environ["SOURCE_DATE_EPOCH"])
    out = subprocess.run(["git", "log", "-1", "--format=%ct", "--", *paths], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    return int(out) if out else source_date_epoch()


class LayerCache:
    """Packed layers by key under `root`: <key>/layer.json (a layers.Layer), <key>/tree (the
    unpacked files of the base and venv layers, the lower directories the layers above them are
    built on), blobs/sha256/<hex>; apt/<release>, the .debs mmdebstrap downloaded.
    `refresh`: every layer is rebuilt once, then its new entry is used."""

    def __init__(self, root: Path, refresh: bool = False) -> None:
        self.root = root
        self.refresh = refresh
        self.rebuilt: set[str] = set()
        (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)

    def blob(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / digest.removeprefix("sha256:")

    def tree(self, key: str) -> Path:
        return self.root / key / "tree"

    def settled_tree(self, key: str, epoch: int) -> Path:
        """`key`'s cached tree with the mtimes its layer's tar holds (clamped to `epoch`), once.
        A step above copies up the directories it writes into (/opt/venv, ...) with their
        mtimes: a tree built minutes ago and one reused from an earlier commit's build would
        otherwise give the layer above different bytes."""
        tree = self.tree(key)
        marker = self.root / key / "mtimes-clamped"
        if not marker.is_file():
            clamp_mtimes(tree, epoch)
            marker.write_text(f"{epoch}\n")
        return tree

    def apt_archives(self, release: str) -> Path:
        path = self.root / "apt" / release
        (path / "partial").mkdir(parents=True, exist_ok=True)
        return path

    def get(self, key: str, with_tree: bool) -> layers.Layer | None:
        entry = self.root / key / "layer.json"
        if (self.refresh and key not in self.rebuilt) or not entry.is_file():
            return None
        layer = layers.Layer.from_json(json.loads(entry.read_text()))
        if not self.blob(layer.digest).is_file() or (with_tree and not self.tree(key).is_dir()):
            return None
        return layer

    @contextmanager
    def new_entry(self, key: str) -> Iterator[Path]:
        """A directory to build `key`'s entry in, renamed into place when the body succeeds."""
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{key}-"))
        try:
            yield tmp
            shutil.rmtree(self.root / key, ignore_errors=True)
            tmp.rename(self.root / key)
            self.rebuilt.add(key)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def put(self, entry: Path, name: str, tree: Path, epoch: int, excludes: tuple[str, ...] = ()
            ) -> layers.Layer:  # fmt: skip
        """Packs `tree` as layer `name` into the cache's blobs and writes entry/layer.json."""
        tmp_blob = entry / "blob.tar.gz"
        digest, diff_id, size = pack_tree(tree, tmp_blob, epoch, excludes)
        tmp_blob.replace(self.blob(digest))
        layer = layers.Layer(name, digest, diff_id, size, CREATED_BY[name])
        (entry / "layer.json").write_text(json.dumps(layer.to_json(), indent=2) + "\n")
        print(f"    layer {name}: {digest} {size / 1e6:.1f} MB", flush=True)
        return layer


def clamp_mtimes(tree: Path, epoch: int) -> None:
    """Every entry of `tree` newer than `epoch` gets `epoch` as its mtime (as tar's
    --clamp-mtime packs it); symlinks themselves, not what they point at."""
    for directory, dirs, files in os.walk(tree):
        for name in (*dirs, *files):
            path = os.path.join(directory, name)
            if os.lstat(path).st_mtime > epoch:
                os.utime(path, (epoch, epoch), follow_symlinks=False)
    if tree.lstat().st_mtime > epoch:
        os.utime(tree, (epoch, epoch), follow_symlinks=False)


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


def pack_tree(
    tree: Path, blob_path: Path, epoch: int, excludes: tuple[str, ...] = ()
) -> tuple[str, str, int]:
    """`tree` as a gzip'd tar at `blob_path`: (blob digest, diff_id, blob size). The gzip header
    has no name and mtime 0, so the blob follows the tar alone."""
    tree.chmod(0o755)  # the layer's "./": a temporary directory is 0700, the image's / is not
    diff, compressed = hashlib.sha256(), hashlib.sha256()
    deflate = zlib.compressobj(6, zlib.DEFLATED, 31)
    size = 0
    with (
        subprocess.Popen(tar_command(tree, epoch, excludes), stdout=subprocess.PIPE) as tar,
        blob_path.open("wb") as out,
    ):
        assert tar.stdout is not None
        while chunk := tar.stdout.read(1 << 20):
            diff.update(chunk)
            data = deflate.compress(chunk)
            compressed.update(data)
            out.write(data)
            size += len(data)
        data = deflate.flush()
        compressed.update(data)
        out.write(data)
        size += len(data)
    if tar.returncode != 0:
        raise SystemExit(f"tar of {tree} failed ({tar.returncode})")
    return f"sha256:{compressed.hexdigest()}", f"sha256:{diff.hexdigest()}", size


def removals(upper: Path) -> list[str]:
    """What a step removed from the layers below (overlayfs whiteouts and opaque directories):
    a layer here only adds and changes files, so any is an error, not a silent difference."""
    found = []
    for path in sorted(upper.rglob("*")):
        info = path.lstat()
        if stat.S_ISCHR(info.st_mode) and info.st_rdev == 0:
            found.append(str(path.relative_to(upper)))
        elif stat.S_ISDIR(info.st_mode) and _xattr(path, "trusted.overlay.opaque") == b"y":
            found.append(f"{path.relative_to(upper)}/ (opaque)")
    return found


def _xattr(path: Path, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return None


@contextmanager
def overlay(lowers: list[Path], upper: Path, work: Path) -> Iterator[Path]:
    """`lowers` (top first) with `upper` on them, mounted with /proc and /dev for a chroot; what
    the body changes lands in `upper`, the files of the layer it makes."""
    merged, scratch = work / "merged", work / "overlay-work"
    for path in (merged, scratch, upper):
        path.mkdir(parents=True, exist_ok=True)
    lower = ":".join(str(path) for path in lowers)
    options = f"lowerdir={lower},upperdir={upper},workdir={scratch}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], check=True)
    try:
        subprocess.run(["mount", "-t", "proc", "proc", str(merged / "proc")], check=True)
        subprocess.run(["mount", "--bind", "/dev", str(merged / "dev")], check=True)
        yield merged
    finally:
        unmount_all(merged)
        shutil.rmtree(scratch, ignore_errors=True)
    gone = removals(upper)
    if gone:
        raise SystemExit(f"a layer's step removed files of the layers below: {gone[:10]}")


def unmount_all(path: Path) -> None:
    """`path` and every mount below it (a step interrupted with uv's cache still bind-mounted),
    detached lazily when busy: a later rmtree of the work directory must never reach into the
    host's uv or apt cache through a mount left behind."""
    if subprocess.run(["umount", "-R", str(path)], check=False, capture_output=True).returncode:
        subprocess.run(["umount", "-R", "-l", str(path)], check=False, capture_output=True)


def step_env(spec: ImageSpec, stage: Path, epoch: int, wheel: str = "") -> dict[str, str]:
    return {
        **os.environ,
        "SOURCE_DATE_EPOCH": str(epoch),
        "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR") or str(cache_dir() / "uv"),
        "KVPILOT_IMAGE_STAGE": str(stage),
        "KVPILOT_WHEEL": wheel,
        "KVPILOT_PASSWD_LINE": spec.passwd_line,
        "KVPILOT_GROUP_LINE": spec.group_line,
        "KVPILOT_OWNED_DIRS": " ".join(d for d in (spec.home, *spec.owned_dirs) if d),
        "KVPILOT_UID": str(specs.UID),
        "KVPILOT_COMPILE_BYTECODE": "1" if spec.compile_bytecode else "",
        "KVPILOT_SYSTEM_SITE_PACKAGES": "1" if spec.system_site_packages else "",
        "VENV": specs.VENV,
    }


def base_inputs(spec: ImageSpec) -> dict[str, bytes]:
    """What decides the base layer: mmdebstrap's arguments (packages, suites, mirrors, dpkg's
    excludes; the paths that vary by machine as placeholders), the user step and its values."""
    argv = mmdebstrap_command(spec, Path("TREE"), Path("APT"), Path("customize.sh"))
    env = step_env(spec, Path("STAGE"), 0)
    user = [env[key] for key in ("KVPILOT_PASSWD_LINE", "KVPILOT_GROUP_LINE",
                                 "KVPILOT_OWNED_DIRS", "KVPILOT_UID")]  # fmt: skip
    return {"mmdebstrap": "\0".join(argv).encode(), "user": "\0".join(user).encode(),
            "customize.sh": HOOK.read_bytes()}  # fmt: skip


def base_layer(spec: ImageSpec, cache: LayerCache) -> tuple[layers.Layer, Path]:
    epoch = layer_epoch(BASE_FILES)
    key = layers.layer_key("base", base_inputs(spec), None, epoch)
    layer = cache.get(key, with_tree=True)
    if layer is None:
        print(f"    building layer base ({key})", flush=True)
        apt = cache.apt_archives(spec.debian_release)
        with cache.new_entry(key) as entry:
            tree = entry / "tree"
            env = step_env(spec, Path("/nonexistent"), epoch)
            try:
                subprocess.run(mmdebstrap_command(spec, tree, apt), env=env, check=True)
            finally:  # a failed mmdebstrap may leave the apt cache mounted in the tree
                unmount_all(tree / "var/cache/apt/archives")
            layer = cache.put(entry, "base", tree, epoch, BASE_EXCLUDES)
    return layer, cache.settled_tree(key, epoch)


def write_requirements(spec: ImageSpec, stage: Path) -> None:
    """The spec's locked pins into stage/requirements.txt, without uv's header, which names the
    output's path: the venv layer's key reads this file."""
    (stage / "requirements.txt").write_text(locked_requirements(spec))


def venv_inputs(spec: ImageSpec, stage: Path) -> dict[str, bytes]:
    env = step_env(spec, stage, 0)
    flags = [env[key] for key in ("KVPILOT_COMPILE_BYTECODE", "KVPILOT_SYSTEM_SITE_PACKAGES",
                                  "VENV")]  # fmt: skip
    return {"requirements.txt": (stage / "requirements.txt").read_bytes(),
            "uv": (ROOT / "hack" / "uv-requirements.txt").read_bytes(),
            "customize.sh": HOOK.read_bytes(), "flags": "\0".join(flags).encode()}  # fmt: skip


def venv_layer(
    spec: ImageSpec, cache: LayerCache, base: tuple[layers.Layer, Path], stage: Path, work: Path
) -> tuple[layers.Layer, Path]:
    epoch = layer_epoch(VENV_FILES)
    key = layers.layer_key("venv", venv_inputs(spec, stage), base[0].digest, epoch)
    layer = cache.get(key, with_tree=True)
    if layer is None:
        print(f"    building layer venv ({key})", flush=True)
        with cache.new_entry(key) as entry:
            tree = entry / "tree"
            with overlay([base[1]], tree, work / "venv-overlay") as root:
                env = step_env(spec, stage, epoch)
                subprocess.run(["bash", str(HOOK), "venv", str(root)], env=env, check=True)
            layer = cache.put(entry, "venv", tree, epoch)
    return layer, cache.settled_tree(key, epoch)


def kernel_inputs(spec: ImageSpec) -> dict[str, bytes]:
    """The kernels' sources and levels, and what builds them: the build stage's packages, or
    (built by this venv's torch) the host's Python, torch and CPU flags, which pick the levels
    the compiler can target and test."""
    inputs = {path: (ROOT / path).read_bytes() for path in KERNEL_SOURCES}
    inputs["levels"] = "\0".join(spec.kernel_levels).encode()
    if spec.kernel_build_packages:
        argv = kernel_stage_command(spec, Path("TREE"), Path("APT"), Path("customize.sh"))
        inputs["stage"] = "\0".join(argv).encode()
    else:
        probe = [sys.executable, "-c", "import platform, torch; "
                 "print(platform.python_version(), torch.__version__)"]  # fmt: skip
        inputs["host"] = subprocess.run(probe, check=True, capture_output=True).stdout
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("flags")][:1]  # fmt: skip
        inputs["cpu"] = "".join(flags).encode()
    return inputs


def kernel_layer(
    spec: ImageSpec, cache: LayerCache, below: layers.Layer, stage: Path, wheel: str, work: Path
) -> layers.Layer:
    epoch = layer_epoch(KERNEL_FILES)
    key = layers.layer_key("kernels", kernel_inputs(spec), below.digest, epoch)
    layer = cache.get(key, with_tree=False)
    if layer is None:
        print(f"    building layer kernels ({key})", flush=True)
        with cache.new_entry(key) as entry:
            tree = entry / "tree"
            kernels = tree / specs.VENV.lstrip("/") / "share" / "kvpilot" / "kernels"
            kernels.mkdir(parents=True)
            if spec.kernel_build_packages:
                env = step_env(spec, stage, epoch, wheel)
                build_stage_kernels(spec, cache, kernels, env, work)
            else:
                for level in spec.kernel_levels:
                    build_kernel([sys.executable], level, kernels, cwd=ROOT)
            for path in [kernels, *kernels.parents]:  # the directories the venv layer has too
                if path == tree:
                    break
                path.chmod(0o755)
            layer = cache.put(entry, "kernels", tree, epoch)
            shutil.rmtree(tree)  # the layers above are not built on it
    return layer


def build_stage_kernels(
    spec: ImageSpec, cache: LayerCache, out: Path, env: dict[str, str], work: Path
) -> None:
    """The kernels of a spec with kernel_build_packages, built in its build stage's root
    filesystem (the base's packages, a compiler and torch's headers, the locked venv and the
    kvpilot wheel) by the image's own python and torch, into `out`; the stage is removed."""
    root = work / "kernel-stage"
    apt = cache.apt_archives(spec.debian_release)
    inside = "/tmp/kvpilot-kernels"
    # the image's PATH: torch's cpp_extension runs the venv's ninja by name
    python = ["chroot", str(root), "env", "-i", f"PATH={spec.env['PATH']}", "HOME=/root",
              f"SOURCE_DATE_EPOCH={env['SOURCE_DATE_EPOCH']}",
              f"{specs.VENV}/bin/python"]  # fmt: skip
    try:
        try:
            subprocess.run(kernel_stage_command(spec, root, apt), env=env, check=True)
        finally:
            unmount_all(root / "var/cache/apt/archives")
        subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")], check=True)
        subprocess.run(["mount", "--bind", "/dev", str(root / "dev")], check=True)
        for step in ("venv", "app"):
            subprocess.run(["bash", str(HOOK), step, str(root)], env=env, check=True)
        for level in spec.kernel_levels:
            build_kernel(python, level, root / inside.lstrip("/"), seen_as=inside)
        shutil.copytree(root / inside.lstrip("/"), out, dirs_exist_ok=True)
    finally:
        for mount in ("tmp/kvpilot-build/uv-cache", "proc", "dev"):
            unmount_all(root / mount)
        shutil.rmtree(root, ignore_errors=True)


def app_layer(
    spec: ImageSpec, cache: LayerCache, venv: tuple[layers.Layer, Path], base_tree: Path,
    stage: Path, wheel: str, epoch: int, work: Path,
) -> layers.Layer:  # fmt: skip
    """kvpilot's wheel installed into the venv: the layer a source change rebuilds."""
    inputs = {"wheel": (stage / wheel).read_bytes(), "customize.sh": HOOK.read_bytes()}
    key = layers.layer_key("app", inputs, venv[0].digest, epoch)
    layer = cache.get(key, with_tree=False)
    if layer is None:
        print(f"    building layer app ({key})", flush=True)
        with cache.new_entry(key) as entry:
            tree = entry / "tree"
            with overlay([venv[1], base_tree], tree, work / "app-overlay") as root:
                env = step_env(spec, stage, epoch, wheel)
                subprocess.run(["bash", str(HOOK), "app", str(root)], env=env, check=True)
            layer = cache.put(entry, "app", tree, epoch)
            shutil.rmtree(tree)
    return layer


def build_wheel(stage: Path, epoch: int) -> str:
    """The kvpilot wheel into `stage` (its zip timestamps `epoch`); its file name. The epoch goes
    to uv alone: the layers' own timestamps (layer_epoch) read SOURCE_DATE_EPOCH as the user's."""
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(epoch)}
    uv("build", "--wheel", "--quiet", "--out-dir", str(stage / "wheel"), env=env)
    (wheel,) = (stage / "wheel").glob("kvpilot-*.whl")
    shutil.move(wheel, stage / wheel.name)
    return wheel.name


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


@contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # another clone building the same image: wait
        yield


def build(
    spec: ImageSpec, out: Path | None = None, layer_cache: Path | None = None,
    refresh: bool = False,
) -> Path:  # fmt: skip
    """Builds `spec` into its layout (replacing an older one) from the layer cache's layers
    whose keys match, building the others; returns the layout's path."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"make images needs {' '.join(missing)}: run `make system-deps` as root")
    if os.geteuid() != 0:
        raise SystemExit("make images needs root (mmdebstrap --mode=root, chroot, mount)")
    layout = layout_dir(spec, out)
    layout.parent.mkdir(parents=True, exist_ok=True)
    epoch = source_date_epoch()
    # The tree the wheel is built from, named before it is built: a commit made while an image
    # builds (minutes) must not be the label of sources it does not hold.
    source = revision()
    cache = LayerCache(layer_cache or layer_cache_dir(), refresh)
    with (
        locked(cache.root / ".lock"),
        tempfile.TemporaryDirectory(dir=cache.root, prefix=f".{spec.name}-") as tmp,
    ):
        work = Path(tmp)
        stage = work / "stage"
        stage.mkdir()
        shutil.copy2(uv_binary(), stage / "uv")
        write_requirements(spec, stage)
        wheel = build_wheel(stage, epoch)
        base = base_layer(spec, cache)
        venv = venv_layer(spec, cache, base, stage, work)
        stack = [base[0], venv[0]]
        if spec.kernel_levels:
            stack.append(kernel_layer(spec, cache, venv[0], stage, wheel, work))
        stack.append(app_layer(spec, cache, venv, base[1], stage, wheel, epoch, work))
        config = spec_config(spec, rfc3339(epoch), source, stack)
        with tempfile.TemporaryDirectory(dir=layout.parent, prefix=f".{spec.name}-") as new:
            write_layout(Path(new) / "layout", cache, config, stack)
            shutil.rmtree(layout, ignore_errors=True)
            (Path(new) / "layout").rename(layout)
    return layout


def blob(layout: Path, digest: object) -> Path:
    return layout / "blobs" / "sha256" / str(digest).removeprefix("sha256:")


def manifest(layout: Path) -> tuple[str, dict[str, Any]]:
    """The layout's (only) manifest: its digest and its parsed JSON."""
    index = json.loads((layout / "index.json").read_text())
    digest = str(index["manifests"][0]["digest"])
    return digest, json.loads(blob(layout, digest).read_text())


def summary(layout: Path) -> str:
    digest, parsed = manifest(layout)
    stack = parsed["layers"]
    size = sum(int(layer["size"]) for layer in stack)
    return f"{layout.name}: {digest}, {len(stack)} layer(s), {size / 1e6:.1f} MB compressed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hack.images", description=__doc__)
    parser.add_argument("images", nargs="*", help=f"of {', '.join(specs.IMAGES)} (default: all)")
    parser.add_argument("--out", type=Path, help="layouts go here instead of the build cache")
    parser.add_argument(
        "--if-changed",
        action="store_true",
        help="build only images whose cached layout was made from another recipe (Dockerfiles,"
        " uv.lock, pyproject.toml, hack/images): what CI runs before the tests",
    )
    parser.add_argument(
        "--refresh",
        action="store_true",
        help="rebuild every layer, the cached ones too: the Debian base with today's archive"
        " (security updates), the venv on it",
    )
    parser.add_argument(
        "--layer-cache",
        type=Path,
        help=f"the layer cache (default: ${LAYER_CACHE_ENV} or <build cache>/layers)",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.images) - set(specs.IMAGES))
    if unknown:
        parser.error(f"no image {', '.join(unknown)}: the images are {', '.join(specs.IMAGES)}")
    for name in args.images or list(specs.IMAGES):
        cached = layout_dir(specs.IMAGES[name], args.out)
        recipe = tree_recipe_digest(specs.IMAGES[name])
        if args.if_changed and cached_recipe_digest(cached) == recipe:
            print(f"==> {name}: the cached image has this recipe, not rebuilt\n    {cached}")
            continue
        print(f"==> building {name}", flush=True)
        layout = build(specs.IMAGES[name], args.out, args.layer_cache, args.refresh)
        print(f"==> {summary(layout)}\n    {layout}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
