"""The pod runner's images mode, pure parts (hack/podrunner/images.py): which pods run from an
image, and the plan a container runs by — its command, user, env and mounts — as a kubelet
derives them from the pod spec and the image config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hack.images import checkout
from hack.images.spec import OPERATOR, RUNTIME
from hack.podrunner import enter, images, pods
from hack.podrunner.images import ImageRef, Mount
from hack.podrunner.imagestore import ImagePullError, ImageStore

DIGEST = "sha256:" + "ab" * 32
PASSWD = "root:x:0:0:root:/root:/bin/bash\nkvpilot:x:10001:10001::/home/kvpilot:/usr/sbin/nologin\n"
GROUP = "root:x:0:\nkvpilot:x:10001:\n"
CPU = "kvpilot-runtime-cpu"


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("ghcr.io/kvpilot/runtime:0.1.0", ImageRef("kvpilot-runtime", "0.1.0", None)),
        ("ghcr.io/kvpilot/operator", ImageRef("kvpilot-operator", "9.9.9", None)),
        (f"ghcr.io/kvpilot/runtime:0.2.0@{DIGEST}", ImageRef("kvpilot-runtime", "0.2.0", DIGEST)),
        (f"ghcr.io/kvpilot/runtime@{DIGEST}", ImageRef("kvpilot-runtime", "9.9.9", DIGEST)),
        ("kvpilot-runtime:0.1.0", ImageRef("kvpilot-runtime", "0.1.0", None)),
        # the CPU variant: released under the runtime's repository with a -cpu tag
        ("ghcr.io/kvpilot/runtime:0.1.0-cpu", ImageRef("kvpilot-runtime-cpu", "0.1.0", None)),
        (f"ghcr.io/kvpilot/runtime:0.2.0-cpu@{DIGEST}", ImageRef(CPU, "0.2.0", DIGEST)),
        ("kvpilot-runtime-cpu:0.1.0", ImageRef("kvpilot-runtime-cpu", "0.1.0", None)),
        ("kvpilot-runtime-cpu", ImageRef("kvpilot-runtime-cpu", "9.9.9", None)),
        ("kvpilot-runtime:0.1.0-cpu", ImageRef("kvpilot-runtime-cpu", "0.1.0", None)),
        # a suffix kvpilot does not build stays in the tag: no layout is cached under it
        ("ghcr.io/kvpilot/runtime:0.1.0-rocm", ImageRef("kvpilot-runtime", "0.1.0-rocm", None)),
        ("ghcr.io/kvpilot/operator:0.1.0-cpu", ImageRef("kvpilot-operator", "0.1.0-cpu", None)),
        ("ghcr.io/kvpilot/runtime-cpu:0.1.0", None),  # not a repository the release pushes
        ("localhost:5000/kvpilot/runtime:0.1.0", None),  # a registry's port is no tag
        ("ghcr.io/kvpilot/runtime-extra:0.1.0", None),
        ("example.invalid/probe-app:test", None),
        ("", None),
    ],
)
def test_kvpilot_images_are_known_by_repository_or_build_name(
    reference: str, expected: ImageRef | None
) -> None:
    assert images.parse_reference(reference, "9.9.9") == expected


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        (
            "ghcr.io/kvpilot/runtime:0.1.0-cpu",
            "build it with `make images IMAGE=kvpilot-runtime-cpu`",
        ),
        ("kvpilot-runtime", "build it with `make images IMAGE=kvpilot-runtime` (as root)"),
        (
            "ghcr.io/kvpilot/runtime:0.0.9-cpu",
            "this checkout builds version 0.1.0, not 0.0.9: name kvpilot-runtime-cpu's :0.1.0 tag,"
            " or run `make images IMAGE=kvpilot-runtime-cpu` (as root) in a checkout of v0.0.9",
        ),
        (
            "ghcr.io/kvpilot/runtime:0.1.0-rocm",
            "no kvpilot image is tagged -rocm (kvpilot builds kvpilot-runtime as :0.1.0,"
            " :0.1.0-cpu (kvpilot-runtime-cpu)): name one of those",
        ),
        (  # another version first, whatever its suffix
            "ghcr.io/kvpilot/operator:0.0.9-rocm",
            "this checkout builds version 0.1.0, not 0.0.9: name kvpilot-operator's :0.1.0 tag",
        ),
        (
            "ghcr.io/kvpilot/operator:0.1.0-cpu",
            "no kvpilot image is tagged -cpu (kvpilot builds kvpilot-operator as :0.1.0)",
        ),
    ],
)
def test_an_image_not_cached_says_what_to_build(reference: str, expected: str) -> None:
    ref = images.parse_reference(reference, "0.1.0")
    assert ref is not None
    assert expected in images.pull_hint(ref, "0.1.0")


def test_a_pre_release_version_is_its_own_tag_not_a_variant() -> None:
    ref = images.parse_reference("ghcr.io/kvpilot/runtime:0.2.0-rc1", "0.2.0-rc1")
    assert ref is not None
    hint = images.pull_hint(ref, "0.2.0-rc1")
    assert hint == "build it with `make images IMAGE=kvpilot-runtime` (as root)"


def test_the_store_refuses_an_uncached_variant_with_what_to_build(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images", tmp_path / "unpacked")
    reference = f"ghcr.io/kvpilot/runtime:{checkout.version()}-cpu"
    ref = images.parse_reference(reference, checkout.version())
    assert ref is not None
    try:
        with pytest.raises(ImagePullError) as raised:
            store.get(ref, reference)
    finally:
        store.shutdown()
    layout = tmp_path / "images" / checkout.version() / CPU
    assert str(raised.value) == (
        f"image {reference} is not in the build cache (no OCI layout at {layout}):"
        f" build it with `make images IMAGE={CPU}` (as root)"
    )


RUNTIME_CONFIG = {"Entrypoint": list(RUNTIME.entrypoint), "Cmd": list(RUNTIME.cmd)}


@pytest.mark.parametrize(
    ("container", "expected"),
    [
        # command replaces the Entrypoint (tini too) and the Cmd, as Kubernetes does
        ({"command": ["kvpilot-runtime"], "args": ["serve"]}, ["kvpilot-runtime", "serve"]),
        ({"command": ["kvpilot-runtime"]}, ["kvpilot-runtime"]),
        # args alone replace the Cmd: the Entrypoint (tini) stays
        ({"args": ["fetch", "--to=/m"]}, ["tini", "--", "kvpilot-runtime", "fetch", "--to=/m"]),
        ({}, [*RUNTIME.entrypoint, *RUNTIME.cmd]),
    ],
)
def test_command_and_args_against_the_images_entrypoint_and_cmd(
    container: dict[str, Any], expected: list[str]
) -> None:
    assert images.container_command({"name": "c", **container}, RUNTIME_CONFIG) == expected


def test_a_container_with_nothing_to_run_says_so() -> None:
    with pytest.raises(ValueError, match="neither it nor its image names a command"):
        images.container_command({"name": "c"}, {})


@pytest.mark.parametrize(
    ("argv", "ports", "expected"),
    [
        (["serve"], [{}], ["serve", "--host", "127.1.0.2"]),
        (["serve", "--host", "0.0.0.0", "-v"], [{}], ["serve", "--host", "127.1.0.2", "-v"]),
        (["fetch"], [], ["fetch"]),
    ],
)
def test_a_serving_container_binds_its_pod_ip(
    argv: list[str], ports: list[Any], expected: list[str]
) -> None:
    assert images.bind_pod_ip(argv, {"ports": ports}, "127.1.0.2") == expected


def pod_with(security: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "p"}, "spec": {"securityContext": security or {}}}


@pytest.mark.parametrize(
    ("pod_security", "container_security", "image_user", "expected"),
    [
        ({}, {}, "10001:10001", (10001, 10001, [10001])),
        ({}, {}, "kvpilot", (10001, 10001, [10001])),  # a name, from the image's passwd
        ({}, {}, "kvpilot:kvpilot", (10001, 10001, [10001])),
        ({}, {}, "", (0, 0, [0])),  # no USER: root
        ({"runAsUser": 2000}, {}, "10001:10001", (2000, 0, [0])),  # no passwd entry: group 0
        ({"runAsUser": 10001}, {}, "0:0", (10001, 10001, [10001])),  # its passwd group
        ({"runAsUser": 2000, "runAsGroup": 3000}, {"runAsUser": 4000}, "", (4000, 3000, [3000])),
        (
            {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 20, "supplementalGroups": [7]},
            {},
            "0",
            (10001, 10001, [7, 20, 10001]),
        ),
    ],
)
def test_the_user_is_the_containers_over_the_pods_over_the_images(
    pod_security: dict[str, Any],
    container_security: dict[str, Any],
    image_user: str,
    expected: tuple[int, int, list[int]],
) -> None:
    container = {"name": "c", "securityContext": container_security}
    found = images.run_as(pod_with(pod_security), container, image_user, PASSWD, GROUP)
    assert found == expected


@pytest.mark.parametrize(
    ("pod_security", "image_user", "message"),
    [
        ({"runAsNonRoot": True}, "0:0", "runAsNonRoot and its image will run as root"),
        ({}, "nobody-here", "user 'nobody-here' is not in its /etc/passwd"),
    ],
)
def test_a_user_that_cannot_run_is_refused_with_the_reason(
    pod_security: dict[str, Any], image_user: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        images.run_as(pod_with(pod_security), {"name": "c"}, image_user, PASSWD, GROUP)


def test_env_is_the_images_under_the_pods_and_none_of_the_hosts() -> None:
    env = images.container_env(
        ["PATH=/opt/venv/bin:/usr/bin", "HF_HOME=/models/.cache", "A=1=2"],
        {"HF_HOME": "/var/cache/kvpilot", "X": "y"},
        "/home/kvpilot",
        "tiny-0",
    )
    assert env == {
        "PATH": "/opt/venv/bin:/usr/bin",
        "HF_HOME": "/var/cache/kvpilot",
        "A": "1=2",
        "HOME": "/home/kvpilot",
        "HOSTNAME": "tiny-0",
        "X": "y",
    }
    assert images.home_of(10001, PASSWD) == "/home/kvpilot" and images.home_of(5, PASSWD) == "/"


def test_volume_mounts_bind_the_runners_directories_at_their_mount_paths(tmp_path: Path) -> None:
    dirs = {"model": tmp_path / "model", "tmp": tmp_path / "tmp", "cfg": tmp_path / "cfg"}
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "a.yaml").write_text("x")
    container = {
        "name": "c",
        "volumeMounts": [
            {"name": "model", "mountPath": "/models/model/", "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cfg", "mountPath": "/etc/app/a.yaml", "subPath": "a.yaml"},
        ],
    }
    message = tmp_path / "termination"
    found = images.volume_mounts(container, dirs, message)
    assert found == [
        Mount(str(tmp_path / "tmp"), "/tmp"),
        Mount(str(tmp_path / "model"), "/models/model", read_only=True),
        Mount(str(message), "/dev/termination-log", is_file=True),
        Mount(str(tmp_path / "cfg" / "a.yaml"), "/etc/app/a.yaml", is_file=True),
    ]
    # mounts inside other mounts come after them: /dev before /dev/termination-log
    targets = [m.target for m in [*images.system_mounts(), *found]]
    assert targets.index("/dev") < targets.index("/dev/shm") < targets.index("/dev/termination-log")


def test_the_plan_of_a_runtime_pod() -> None:
    """What the operator writes for the runtime (command set, pod user, read-only root) against
    the runtime image's config: the pod's command without tini, as on a real cluster."""
    pod = {
        "metadata": {"name": "tiny-0", "namespace": "ml"},
        "spec": {"securityContext": {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001}},
    }
    container = {
        "name": "runtime",
        "command": ["kvpilot-runtime"],
        "args": ["serve", "--port=8000"],
        "securityContext": {"readOnlyRootFilesystem": True},
    }
    image = {"config": {**RUNTIME_CONFIG, "User": RUNTIME.user, "Env": RUNTIME.env_list()},
             "passwd": PASSWD, "group": GROUP}  # fmt: skip
    layers = images.Layers(Path("/unpacked/rootfs"), Path("/pods/u/containers/runtime"))
    mounts = images.node_path_mounts([Path("/repo/models")])
    plan = images.plan(pod, container, image, layers, mounts, {"X": "1"})
    assert plan.argv == ["kvpilot-runtime", "serve", "--port=8000"]
    assert (plan.uid, plan.gid, plan.groups, plan.workdir) == (10001, 10001, [10001], "/")
    assert plan.read_only_root and plan.lower == "/unpacked/rootfs"
    assert plan.root == "/pods/u/containers/runtime/root"
    assert plan.env["PATH"] == RUNTIME.env["PATH"] and plan.env["X"] == "1"
    assert plan.env["HOME"] == "/home/kvpilot" and plan.env["HOSTNAME"] == "tiny-0"
    assert Mount("/repo/models", "/repo/models", read_only=True) in plan.mounts
    assert [m.target for m in plan.mounts[:4]] == ["/proc", "/sys", "/dev", "/dev/shm"]
    assert plan.to_json()["mounts"][0] == {"source": "proc", "target": "/proc", "kind": "proc",
                                           "read_only": False, "is_file": False}  # fmt: skip


def test_the_operator_image_runs_the_gateway_the_chart_names() -> None:
    config = {"Entrypoint": list(OPERATOR.entrypoint), "Cmd": list(OPERATOR.cmd)}
    container = {"name": "gateway", "command": ["kvpilot-gateway"], "args": ["--port=8080"]}
    assert images.container_command(container, config) == ["kvpilot-gateway", "--port=8080"]


def test_unshare_and_its_child() -> None:
    argv = images.unshare_argv("unshare", "/venv/bin/python", "/r/enter.py", "/p/plan.json")
    assert argv[:4] == ["unshare", "--mount", "--pid", "--fork"]
    assert argv[-4:] == ["/venv/bin/python", "-I", "/r/enter.py", "/p/plan.json"]
    assert images.namespace_init_pid("4242 \n") == 4242
    assert images.namespace_init_pid("") is None


def test_writable_volumes_are_empty_dirs_and_claims() -> None:
    pod = {"spec": {"volumes": [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "persistentVolumeClaim": {"claimName": "c"}},
        {"name": "host", "hostPath": {"path": "/x"}},
        {"name": "cfg", "configMap": {"name": "c"}},
    ]}}  # fmt: skip
    assert pods.writable_volumes(pod) == ["tmp", "cache"]


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/var/run/secrets/x", "run/secrets/x"),  # Debian's /var/run -> /run, inside the root
        ("/etc/resolv.conf", "run/resolv.conf"),  # a relative link
        ("/opt/../../../etc/hosts", "etc/hosts"),  # .. stops at the root
        ("/escape/passwd", "etc/passwd"),  # an absolute link to the host's /etc is the image's
        ("/models/model/", "models/model"),
        ("/", ""),
    ],
)
def test_mount_targets_resolve_symlinks_inside_the_root(
    tmp_path: Path, path: str, expected: str
) -> None:
    """enter.in_root: what a mount point is made at, never outside the container's root."""
    root = tmp_path / "root"
    for folder in ("var", "etc", "run", "opt"):
        (root / folder).mkdir(parents=True)
    (root / "var" / "run").symlink_to("/run")
    (root / "etc" / "resolv.conf").symlink_to("../run/resolv.conf")
    (root / "escape").symlink_to("/etc")
    assert enter.in_root(root, path) == (root / expected if expected else root)


def test_a_symlink_loop_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(OSError, match="too many symbolic links"):
        enter.in_root(tmp_path, "/a/x")


def test_whiteouts_of_a_layer() -> None:
    names = ["./etc/", "./etc/.wh.motd", "./var/cache/.wh..wh..opq", ".wh.tmp", "./opt/venv/x"]
    found = images.whiteouts(names)
    assert found.removed == ["etc/motd", "tmp"] and found.opaque_dirs == ["var/cache"]
