"""The build's steps that run tools as root: the environment customize.sh's steps read, an
overlay mount to chroot into (its upper directory the new layer), unmounting what a step left
mounted, the paged-attention kernels (on the host or in a build stage's root filesystem) and the
kvpilot wheel. The argv of mmdebstrap and tar are pure (hack/images/layers.py).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hack.images import layers
from hack.images import spec as specs
from hack.images.checkout import cache_dir, uv
from hack.images.layer_cache import LayerCache
from hack.images.spec import ImageSpec


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


def unmount_all(path: Path) -> None:
    """`path` and every mount below it (a step interrupted with uv's cache still bind-mounted),
    detached lazily when busy: a later rmtree of the work directory must never reach into the
    host's uv or apt cache through a mount left behind."""
    if subprocess.run(["umount", "-R", str(path)], check=False, capture_output=True).returncode:
        subprocess.run(["umount", "-R", "-l", str(path)], check=False, capture_output=True)


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
            subprocess.run(layers.kernel_stage_command(spec, root, apt), env=env, check=True)
        finally:
            unmount_all(root / "var/cache/apt/archives")
        subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")], check=True)
        subprocess.run(["mount", "--bind", "/dev", str(root / "dev")], check=True)
        for step in ("venv", "app"):
            subprocess.run(["bash", str(layers.HOOK), step, str(root)], env=env, check=True)
        for level in spec.kernel_levels:
            build_kernel(python, level, root / inside.lstrip("/"), seen_as=inside)
        shutil.copytree(root / inside.lstrip("/"), out, dirs_exist_ok=True)
    finally:
        for mount in ("tmp/kvpilot-build/uv-cache", "proc", "dev"):
            unmount_all(root / mount)
        shutil.rmtree(root, ignore_errors=True)


def build_wheel(stage: Path, epoch: int) -> str:
    """The kvpilot wheel into `stage` (its zip timestamps `epoch`); its file name. The epoch goes
    to uv alone: the layers' own timestamps (layer_epoch) read SOURCE_DATE_EPOCH as the user's."""
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(epoch)}
    uv("build", "--wheel", "--quiet", "--out-dir", str(stage / "wheel"), env=env)
    (wheel,) = (stage / "wheel").glob("kvpilot-*.whl")
    shutil.move(wheel, stage / wheel.name)
    return wheel.name
