"""The pod runner's images mode, pure parts: a container whose image is one `make images` builds
runs from that image's root filesystem, as a kubelet with a container runtime would run it.

The plan for one container (ContainerPlan) is data: the image's unpacked root filesystem under a
per-container overlay (the image stays read-only and shared; each start gets a fresh top layer),
/proc, a small /dev, the host's /etc/hosts and /etc/resolv.conf (pods share the host's network:
each binds its own loopback pod IP, as in the host mode), the pod's volumes bind-mounted at their
mountPaths, then the command with Kubernetes' rules for command/args against the image's
Entrypoint/Cmd, as the pod's user, in its working directory, with the image's Env under the pod's.
enter.py carries it out as PID 1 of new mount and PID namespaces (`unshare`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hack.images.spec import IMAGES
from hack.release import REPOSITORIES, VARIANT_TAGS

# Host devices a container gets (what runc binds into its /dev)
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# The host files a kubelet mounts into every container of a pod on the host's network
HOST_FILES = ("/etc/hosts", "/etc/resolv.conf")
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
# An image's init: in an image it is PID 1; on the host the runner itself starts, signals and
# reaps a container's process, as the init would.
INIT = ("tini", "--")


@dataclass(frozen=True)
class ImageRef:
    name: str  # the image `make images` builds (hack/images/spec.py), e.g. kvpilot-runtime
    tag: str  # the version directory of the build cache
    digest: str | None  # sha256:..., when the reference pins one


def parse_reference(reference: str, default_tag: str) -> ImageRef | None:
    """The kvpilot image a pod's `image` names (a released repository, ghcr.io/kvpilot/runtime,
    or the build's own name, kvpilot-runtime or kvpilot-runtime-cpu), with its version; None for
    any other image (which the runner runs from the host's venv, as without images mode).

    A variant's tag suffix names its own layout, as the release pushes it
    (ghcr.io/kvpilot/runtime:0.1.0-cpu is kvpilot-runtime-cpu, version 0.1.0). An unknown suffix
    stays in the tag, where no layout is cached: the pull fails with pull_hint's message."""
    digest_match = _DIGEST.search(reference)
    digest = digest_match.group(0)[1:] if digest_match else None
    rest = _DIGEST.sub("", reference)
    repository, tag = rest, default_tag
    if ":" in rest.rsplit("/", 1)[-1]:
        repository, tag = rest.rsplit(":", 1)
    names = {repo: name for name, repo in REPOSITORIES.items()}
    name = names.get(repository) or (repository if repository in IMAGES else None)
    if name is None:
        return None
    for variant, (base, suffix) in VARIANT_TAGS.items():
        if name == base and tag.endswith(f"-{suffix}"):
            return ImageRef(variant, tag.removesuffix(f"-{suffix}"), digest)
    return ImageRef(name, tag, digest)


def pull_hint(ref: ImageRef, version: str) -> str:
    """What to build for an image whose layout is not cached, `version` being the one this
    checkout's `make images` builds."""
    if ref.tag == version:  # this checkout's own tag (a pre-release one too: 0.2.0-rc1)
        return f"build it with `make images IMAGE={ref.name}` (as root)"
    base, _, suffix = ref.tag.partition("-")
    if base != version:  # first: another version's tag is not built here, whatever its suffix
        return (
            f"this checkout builds version {version}, not {base}: name {ref.name}'s :{version}"
            f" tag, or run `make images IMAGE={ref.name}` (as root) in a checkout of v{base}"
        )
    known = [f":{version}"] + [
        f":{version}-{s} ({variant})" for variant, (b, s) in VARIANT_TAGS.items() if b == ref.name
    ]
    return (
        f"no kvpilot image is tagged -{suffix} (kvpilot builds {ref.name} as"
        f" {', '.join(known)}): name one of those"
    )


@dataclass(frozen=True)
class Mount:
    source: str  # a host path; "proc", "tmpfs" or "sysfs" for those file systems
    target: str  # the path inside the container
    kind: str = "bind"  # bind | proc | tmpfs | sysfs
    read_only: bool = False
    is_file: bool = False  # a bind of a file: its mount point is a file


@dataclass(frozen=True)
class ContainerPlan:
    """What enter.py does, in order: overlay the image, mount, chroot, drop to the user, exec."""

    lower: str  # the image's unpacked rootfs, shared and never written
    upper: str  # this start's writable layer
    work: str  # overlayfs' work directory (same file system as upper)
    root: str  # where the overlay is mounted: the container's /
    mounts: list[Mount]
    devices: list[str]  # host device nodes bound into the container's /dev
    read_only_root: bool
    uid: int
    gid: int
    groups: list[int]
    workdir: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def host_entrypoint(reference: str) -> list[str]:
    """What runs a container without `command` in the host mode: the kvpilot image's
    Entrypoint (hack/images/spec.py) without its init; [] for an image kvpilot does not build."""
    ref = parse_reference(reference, "")
    if ref is None:
        return []
    entrypoint = list(IMAGES[ref.name].entrypoint)
    return entrypoint[len(INIT) :] if tuple(entrypoint[: len(INIT)]) == INIT else entrypoint


def container_command(container: Mapping[str, Any], image_config: Mapping[str, Any]) -> list[str]:
    """Kubernetes' rule: `command` replaces the image's Entrypoint (and its Cmd), `args` replace
    its Cmd; with neither, Entrypoint + Cmd."""
    entrypoint = list(image_config.get("Entrypoint") or [])
    cmd = list(image_config.get("Cmd") or [])
    if container.get("command"):
        argv = [*container["command"], *(container.get("args") or [])]
    elif container.get("args"):
        argv = [*entrypoint, *container["args"]]
    else:
        argv = [*entrypoint, *cmd]
    if not argv:
        raise ValueError(
            f"container {container['name']}: neither it nor its image names a command to run"
        )
    return [str(part) for part in argv]


def bind_pod_ip(argv: list[str], container: Mapping[str, Any], pod_ip: str) -> list[str]:
    """A serving container (one with ports) binds its pod IP: `--host`, as in the host mode."""
    if not container.get("ports"):
        return argv
    if "--host" in argv:
        index = argv.index("--host") + 1
        return [*argv[:index], pod_ip, *argv[index + 1 :]]
    return [*argv, "--host", pod_ip]


def _lookup(table: str, name: str) -> int | None:
    """The numeric id of `name` in /etc/passwd or /etc/group text (the image's)."""
    for line in table.splitlines():
        fields = line.split(":")
        if len(fields) > 3 and fields[0] == name and fields[2].isdigit():
            return int(fields[2])
    return None


def _numeric(value: str, table: str, file: str) -> int:
    """A numeric id, or a name looked up in the image's /etc/`file`."""
    if value.isdigit():
        return int(value)
    found = _lookup(table, value)
    if found is None:
        raise ValueError(f"the image's user {value!r} is not in its /etc/{file}")
    return found


def primary_gid(uid: int, passwd: str) -> int:
    """The user's group in the image's /etc/passwd; 0 when it has no entry (containerd's)."""
    for line in passwd.splitlines():
        fields = line.split(":")
        if len(fields) > 3 and fields[2] == str(uid) and fields[3].isdigit():
            return int(fields[3])
    return 0


def run_as(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    image_user: str,
    passwd: str = "",
    group: str = "",
) -> tuple[int, int, list[int]]:
    """(uid, gid, supplementary groups), as containerd derives them: the container's
    securityContext over the pod's over the image's User (`uid[:gid]` or names in the image's
    files); a uid from a securityContext without runAsGroup takes its passwd group, else 0.
    fsGroup and supplementalGroups join the groups; runAsNonRoot with uid 0 is refused."""
    pod_security = pod["spec"].get("securityContext") or {}
    own = container.get("securityContext") or {}
    user_part, _, group_part = (image_user or "0").partition(":")
    uid = own.get("runAsUser", pod_security.get("runAsUser"))
    if uid is None:
        uid = _numeric(user_part, passwd, "passwd")
    else:
        uid, group_part = int(uid), ""  # the image's group goes with the image's user
    gid = own.get("runAsGroup", pod_security.get("runAsGroup"))
    if gid is None:
        gid = _numeric(group_part, group, "group") if group_part else primary_gid(uid, passwd)
    non_root = own.get("runAsNonRoot", pod_security.get("runAsNonRoot"))
    if non_root and uid == 0:
        raise ValueError(
            f"container {container['name']} has runAsNonRoot and its image will run as root:"
            " set runAsUser, or use an image with a non-root USER"
        )
    extra = [pod_security.get("fsGroup"), *(pod_security.get("supplementalGroups") or [])]
    groups = sorted({int(gid), *(int(g) for g in extra if g is not None)})
    return uid, int(gid), groups


def home_of(uid: int, passwd: str) -> str:
    """HOME as container runtimes set it: the user's home in the image's /etc/passwd, else /."""
    for line in passwd.splitlines():
        fields = line.split(":")
        if len(fields) > 5 and fields[2] == str(uid):
            return fields[5] or "/"
    return "/"


def container_env(
    image_env: Sequence[str], pod_env: Mapping[str, str], home: str, hostname: str
) -> dict[str, str]:
    """The image's Env, HOSTNAME and HOME, then the pod's (which win); nothing of the host's."""
    env = dict(entry.split("=", 1) for entry in image_env if "=" in entry)
    env.setdefault("HOME", home)
    return {**env, "HOSTNAME": hostname, **pod_env}


def volume_mounts(
    container: Mapping[str, Any], dirs: Mapping[str, Path], termination_file: Path
) -> list[Mount]:
    """The container's volumeMounts as binds of the runner's directories (subPath inside them,
    readOnly kept), and its termination-message file."""
    mounts = []
    for mount in container.get("volumeMounts") or []:
        source = dirs[mount["name"]] / mount.get("subPath", "")
        read_only = bool(mount.get("readOnly"))
        mounts.append(Mount(str(source).rstrip("/"), mount["mountPath"].rstrip("/") or "/",
                            read_only=read_only, is_file=source.is_file()))  # fmt: skip
    path = str(container.get("terminationMessagePath") or "/dev/termination-log")
    mounts.append(Mount(str(termination_file), path, is_file=True))
    # shorter paths first, so /models is mounted before /models/draft inside it
    return sorted(mounts, key=lambda m: m.target.count("/"))


def system_mounts() -> list[Mount]:
    """/proc of the new PID namespace, a read-only /sys, a /dev of its own with /dev/shm, and
    the host's name-resolution files."""
    return [
        Mount("proc", "/proc", kind="proc"),
        Mount("sysfs", "/sys", kind="sysfs", read_only=True),
        Mount("tmpfs", "/dev", kind="tmpfs"),
        Mount("tmpfs", "/dev/shm", kind="tmpfs"),
        *(Mount(path, path, read_only=True, is_file=True) for path in HOST_FILES),
    ]


@dataclass(frozen=True)
class Layers:
    """Where one container start's file system lives: the image's rootfs and this start's
    overlay directories (under the pod's directory)."""

    lower: Path
    container_dir: Path

    def overlay(self) -> dict[str, str]:
        return {
            "lower": str(self.lower),
            "upper": str(self.container_dir / "upper"),
            "work": str(self.container_dir / "work"),
            "root": str(self.container_dir / "root"),
        }


def node_path_mounts(node_paths: Sequence[Path]) -> list[Mount]:
    """Directories of the node every container sees read-only at the same path (the dev
    cluster's checkout of models/, so a file:// model there loads as it does in the host mode)."""
    return [Mount(str(path), str(path), read_only=True) for path in node_paths]


def plan(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    image: Mapping[str, Any],
    layers: Layers,
    mounts: list[Mount],
    env: Mapping[str, str],
) -> ContainerPlan:
    """The plan for `container` of `pod` from `image` ({config, passwd, group}: the image's
    config and its /etc files); `mounts` (node paths, then volume_mounts), `env` the pod's."""
    config = image["config"]
    uid, gid, groups = run_as(pod, container, str(config.get("User") or ""), image["passwd"],
                              image["group"])  # fmt: skip
    security = container.get("securityContext") or {}
    workdir = container.get("workingDir") or config.get("WorkingDir") or "/"
    home = home_of(uid, image["passwd"])
    return ContainerPlan(
        **layers.overlay(),
        mounts=[*system_mounts(), *mounts],
        devices=list(DEVICES),
        read_only_root=bool(security.get("readOnlyRootFilesystem")),
        uid=uid,
        gid=gid,
        groups=groups,
        workdir=workdir,
        argv=container_command(container, config),
        env=container_env(config.get("Env") or [], env, home, pod["metadata"]["name"]),
    )


def unshare_argv(unshare: str, python: str, enter_script: str, plan_file: str) -> list[str]:
    """New mount and PID namespaces (the host's network); enter.py becomes PID 1 and execs the
    container's command. --kill-child: when the runner kills unshare, the namespace goes too
    (unshare passes no signal on: SIGTERM goes to PID 1 itself, namespace_init_pid)."""
    return [unshare, "--mount", "--pid", "--fork", "--kill-child=SIGKILL", "--",
            python, "-I", enter_script, plan_file]  # fmt: skip


def namespace_init_pid(children: str) -> int | None:
    """PID 1 of the container's namespace, as the host numbers it: unshare's only child
    (`children`: unshare's /proc/<pid>/task/<pid>/children)."""
    found = children.split()
    return int(found[0]) if found else None


def exec_argv(init_pid: int, plan: ContainerPlan, command: list[str]) -> list[str]:
    """An exec hook (preStop) run inside the container: its namespaces, root and working
    directory, as its user (the env comes with the call)."""
    return ["nsenter", f"--target={init_pid}", "--mount", "--pid", "--root", "--wd",
            f"--setgid={plan.gid}", f"--setuid={plan.uid}", "--", *command]  # fmt: skip


@dataclass(frozen=True)
class Whiteouts:
    removed: list[str]  # paths a layer deletes from the layers below (`.wh.<name>`)
    opaque_dirs: list[str]  # directories it empties of what lies below (`.wh..wh..opq`)


def whiteouts(names: Sequence[str]) -> Whiteouts:
    """The OCI image spec's whiteout entries among a layer's tar member names."""
    removed, opaque = [], []
    for raw in names:
        name = raw.removeprefix("./").rstrip("/")
        folder, _, base = name.rpartition("/")
        if base == ".wh..wh..opq":
            opaque.append(folder)
        elif base.startswith(".wh."):
            removed.append(f"{folder}/{base[4:]}" if folder else base[4:])
    return Whiteouts(removed, opaque)
