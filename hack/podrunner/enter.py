"""`python -I enter.py PLAN.json`: PID 1 of a container's new mount and PID namespaces (the pod
runner's images mode starts it under `unshare`); carries out an images.ContainerPlan and execs
the container's command, which then is PID 1.

Standard library only, run by path with -I: the container's environment (its PYTHONPATH, say)
must not change how this script runs, and the plan's env is all the command gets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MAX_SYMLINKS = 40


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)  # the host's, on the runner's PATH


def in_root(root: Path, path: str) -> Path:
    """`path` inside `root` with its symlinks resolved as the container will see them: an
    absolute link (Debian's /var/run -> /run) is relative to `root`, never the host's /, so no
    mount point or mount lands outside the container (what runc's securejoin does)."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    current, hops = root, 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            current = root if current == root else current.parent
            continue
        candidate = current / part
        if not candidate.is_symlink():
            current = candidate
            continue
        hops += 1
        if hops > MAX_SYMLINKS:
            raise OSError(f"too many symbolic links under {root} resolving {path}")
        link = os.readlink(candidate)
        current = root if link.startswith("/") else current
        parts = [p for p in link.split("/") if p not in ("", ".")] + parts
    return current


def mount_point(path: Path, is_file: bool) -> None:
    """An empty file or directory to mount on (made in the overlay's upper layer)."""
    if is_file:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
    else:
        path.mkdir(parents=True, exist_ok=True)


def mount_one(root: Path, spec: dict[str, Any]) -> None:
    target = in_root(root, spec["target"])
    mount_point(target, spec["is_file"])
    if spec["kind"] == "bind":
        mount("--bind", spec["source"], str(target))
        if spec["read_only"]:
            mount("-o", "remount,bind,ro", str(target))
        return
    options = "ro,nosuid,nodev,noexec" if spec["read_only"] else "nosuid,nodev"
    mount("-t", spec["kind"], "-o", options, spec["source"], str(target))


def populate_dev(root: Path, devices: list[str]) -> None:
    """The host's device nodes bound over empty files, and the usual links (runc's /dev)."""
    dev = root / "dev"
    for name in devices:
        (dev / name).touch()
        mount("--bind", f"/dev/{name}", str(dev / name))
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):  # fmt: skip
        (dev / name).symlink_to(target)


def build_root(plan: dict[str, Any]) -> Path:
    root = Path(plan["root"])
    for folder in (plan["upper"], plan["work"], plan["root"]):
        Path(folder).mkdir(parents=True, exist_ok=True)
    overlay = f"lowerdir={plan['lower']},upperdir={plan['upper']},workdir={plan['work']}"
    mount("-t", "overlay", "-o", overlay, "overlay", str(root))
    for spec in plan["mounts"]:
        mount_one(root, spec)
        if spec["target"] == "/dev":
            populate_dev(root, plan["devices"])
    in_root(root, plan["workdir"]).mkdir(parents=True, exist_ok=True)  # as the kubelet does
    if plan["read_only_root"]:  # after the mount points exist: the volumes stay writable
        mount("-o", "remount,ro", str(root))
    return root


def main(argv: list[str]) -> None:
    plan = json.loads(Path(argv[1]).read_text())
    root = build_root(plan)
    os.chroot(root)
    os.chdir(plan["workdir"])
    os.setgroups(plan["groups"])
    os.setgid(plan["gid"])
    os.setuid(plan["uid"])
    command = plan["argv"]
    try:
        os.execvpe(command[0], command, plan["env"])
    except OSError as err:
        print(f"podrunner: cannot start {command[0]!r} in the image: {err}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv)
