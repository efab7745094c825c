"""`make images`: the OCI images of hack/images/spec.py, built without a container engine.

    python -m hack.images [kvpilot-operator] [kvpilot-runtime] [kvpilot-runtime-cpu] [--out DIR]

Per image: a Debian root filesystem (mmdebstrap, essential variant plus the spec's packages), the
locked virtualenv installed into it from uv.lock by uv running inside it (customize.sh), the
kvpilot wheel, a non-root user; mmdebstrap packs it as one tar (sorted entries, mtimes clamped to
SOURCE_DATE_EPOCH, no device nodes) and umoci writes it as a layer of an OCI layout with the image
config, every timestamp SOURCE_DATE_EPOCH. The same commit, uv.lock and Debian archive state give
the same manifest digest. Needs root (mmdebstrap --mode=root, chroot, a bind mount of uv's cache).
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
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


def mmdebstrap_command(spec: ImageSpec, tarball: Path) -> list[str]:
    """The root filesystem as one reproducible tar: essential packages (no apt, no compilers)
    plus the spec's, documentation left out, the venv and user added by customize.sh."""
    return _mmdebstrap(spec, spec.debian_packages, "tar", tarball)


def kernel_stage_command(spec: ImageSpec, root: Path) -> list[str]:
    """The build stage of a spec with kernel_build_packages: the image's root filesystem (the
    same hook, so the same venv and torch) plus a compiler and torch's headers, as a directory
    the kernels are built in (build_stage_kernels); it never becomes a layer."""
    packages = (*spec.debian_packages, *spec.kernel_build_packages)
    return _mmdebstrap(spec, packages, "directory", root)


def _mmdebstrap(spec: ImageSpec, packages: tuple[str, ...], fmt: str, out: Path) -> list[str]:
    dpkg = [f"--dpkgopt=path-exclude={path}" for path in specs.DPKG_PATH_EXCLUDES]
    dpkg += [f"--dpkgopt=path-include={path}" for path in specs.DPKG_PATH_INCLUDES]
    return [
        "mmdebstrap",
        "--mode=root",
        "--variant=essential",
        f"--format={fmt}",
        f"--include={','.join(packages)}",
        *dpkg,
        "--skip=output/dev",  # the container runtime makes /dev; nodes in a layer break rootless
        f'--customize-hook=bash {HOOK} "$1"',
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
    "hack/images/customize.sh",
)  # fmt: skip
RECIPE_LABEL = "dev.kvpilot.image.recipe"


def recipe_digest(files: Mapping[str, bytes]) -> str:
    """SHA-256 over the recipe's files, by path (sorted), each path and its length framed."""
    digest = hashlib.sha256()
    for path in sorted(files):
        content = files[path]
        digest.update(f"{path}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()


def tree_recipe_digest(spec: ImageSpec) -> str:
    return _tree_recipe_digest(spec.name)


@functools.cache  # by name: a spec holds a dict, so it is not hashable
def _tree_recipe_digest(name: str) -> str:
    files = {path: (ROOT / path).read_bytes() for path in RECIPE}
    files["requirements.txt"] = locked_requirements(specs.IMAGES[name]).encode()
    return recipe_digest(files)


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


def umoci_config_args(spec: ImageSpec, created: str, source: str) -> list[str]:
    """`umoci config` flags for the spec's user, entrypoint, command, env, ports and volumes."""
    args = ["--no-history", f"--created={created}", "--os=linux", "--architecture=amd64"]
    args.append(f"--config.user={spec.user}")
    args += [f"--config.entrypoint={part}" for part in spec.entrypoint]
    args += [f"--config.cmd={part}" for part in spec.cmd]
    args += [f"--config.env={entry}" for entry in spec.env_list()]
    args += [f"--config.exposedports={port}/tcp" for port in spec.exposed_ports]
    args += [f"--config.volume={volume}" for volume in spec.volumes]
    args.append(f"--config.label=org.opencontainers.image.version={version()}")
    args.append(f"--config.label=org.opencontainers.image.revision={source}")
    args.append(f"--config.label={RECIPE_LABEL}={tree_recipe_digest(spec)}")
    return args


def uv_binary() -> Path:
    """The project's pinned uv (hack/uv.sh installs it on first use); copied into the root
    filesystem for the install and removed before packing."""
    subprocess.run(["bash", str(ROOT / "hack" / "uv.sh"), "--version"], check=True)
    pins = (ROOT / "hack" / "uv-requirements.txt").read_bytes()
    return cache_dir() / "tools" / f"uv-{hashlib.sha256(pins).hexdigest()[:16]}" / "bin" / "uv"


def uv(*args: str) -> None:
    subprocess.run(["bash", str(ROOT / "hack" / "uv.sh"), *args], cwd=ROOT, check=True)


def stage_inputs(spec: ImageSpec, stage: Path, epoch: int) -> str:
    """uv, the locked requirements of the spec's extras (hashes included) and the kvpilot wheel
    into `stage`; returns the wheel's file name."""
    shutil.copy2(uv_binary(), stage / "uv")
    uv(*export_args(spec), "--output-file", str(stage / "requirements.txt"))
    os.environ["SOURCE_DATE_EPOCH"] = str(epoch)  # the wheel's zip timestamps
    uv("build", "--wheel", "--quiet", "--out-dir", str(stage / "wheel"))
    (wheel,) = (stage / "wheel").glob("kvpilot-*.whl")
    shutil.move(wheel, stage / wheel.name)
    if not spec.kernel_build_packages:
        for level in spec.kernel_levels:
            build_kernel([sys.executable], level, stage / "kernels", cwd=ROOT)
    return wheel.name


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


def build_stage_kernels(spec: ImageSpec, stage: Path, env: dict[str, str], work: Path) -> None:
    """The kernels of a spec with kernel_build_packages, built in its build stage's root
    filesystem by the image's own python and torch, into stage/kernels; the stage is removed."""
    root = work / "kernel-stage"
    subprocess.run(kernel_stage_command(spec, root), env=env, check=True)
    inside = "/tmp/kvpilot-kernels"
    # the image's PATH: torch's cpp_extension runs the venv's ninja by name
    python = ["chroot", str(root), "env", "-i", f"PATH={spec.env['PATH']}", "HOME=/root",
              f"SOURCE_DATE_EPOCH={env['SOURCE_DATE_EPOCH']}",
              f"{specs.VENV}/bin/python"]  # fmt: skip
    subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")], check=True)
    try:
        for level in spec.kernel_levels:
            build_kernel(python, level, root / inside.lstrip("/"), seen_as=inside)
        shutil.copytree(root / inside.lstrip("/"), stage / "kernels")
    finally:
        subprocess.run(["umount", str(root / "proc")], check=False)
        shutil.rmtree(root, ignore_errors=True)


def hook_env(spec: ImageSpec, stage: Path, wheel: str, epoch: int) -> dict[str, str]:
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


def pack(spec: ImageSpec, tarball: Path, layout: Path, epoch: int, source: str) -> None:
    """The tar as the only layer of a new OCI layout, then the config; no stray blobs."""
    image = f"{layout}:{version()}"
    created = rfc3339(epoch)
    subprocess.run(["umoci", "init", "--layout", str(layout)], check=True)
    subprocess.run(["umoci", "new", "--image", image], check=True)
    subprocess.run(
        ["umoci", "raw", "add-layer", "--image", image, f"--history.created={created}",
         "--history.created_by=make images (hack/images/build.py)", str(tarball)],
        check=True,
    )  # fmt: skip
    config = umoci_config_args(spec, created, source)
    subprocess.run(["umoci", "config", "--image", image, *config], check=True)
    subprocess.run(["umoci", "gc", "--layout", str(layout)], check=True)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # another clone building the same image: wait
        yield


def build(spec: ImageSpec, out: Path | None = None) -> Path:
    """Builds `spec` into its layout (replacing an older one) and returns the layout's path."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"make images needs {' '.join(missing)}: run `make system-deps` as root")
    if os.geteuid() != 0:
        raise SystemExit("make images needs root (mmdebstrap --mode=root, chroot, mount)")
    layout = layout_dir(spec, out)
    epoch = source_date_epoch()
    # The tree the wheel is built from, named before it is built: a commit made while an image
    # builds (minutes) must not be the label of sources it does not hold.
    source = revision()
    with (
        locked(layout.with_name(layout.name + ".lock")),
        tempfile.TemporaryDirectory(dir=layout.parent, prefix=f".{spec.name}-") as tmp,
    ):
        work = Path(tmp)
        (work / "stage").mkdir()
        wheel = stage_inputs(spec, work / "stage", epoch)
        tarball = work / "rootfs.tar"
        env = hook_env(spec, work / "stage", wheel, epoch)
        if spec.kernel_build_packages:
            build_stage_kernels(spec, work / "stage", env, work)
        subprocess.run(mmdebstrap_command(spec, tarball), env=env, check=True)
        pack(spec, tarball, work / "layout", epoch, source)
        shutil.rmtree(layout, ignore_errors=True)
        (work / "layout").rename(layout)
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
    layers = parsed["layers"]
    size = sum(int(layer["size"]) for layer in layers)
    return f"{layout.name}: {digest}, {len(layers)} layer(s), {size / 1e6:.1f} MB compressed"


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
        layout = build(specs.IMAGES[name], args.out)
        print(f"==> {summary(layout)}\n    {layout}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
