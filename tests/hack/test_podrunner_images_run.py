"""The pod runner's images mode, run for real: the operator image `make images` cached, unpacked by
the runner's ImageStore, and a container started from it the way the runner starts one (a plan,
enter.py as PID 1 under `unshare`): its user, its read-only root, its volumes, its /dev and
/proc. Skipped where the image is not cached or there is no root (as tests/packaging)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hack.images import checkout
from hack.images.spec import OPERATOR, UID
from hack.podrunner import images
from hack.podrunner.imagestore import ImageNotReadyError, ImagePullError, ImageStore, Unpacked
from hack.podrunner.runner import ENTER_SCRIPT
from tests.support import oci_images

pytestmark = pytest.mark.slow
SCRIPT = """
id -u; id -G; echo "$HOME"; pwd; tr '\\0\\n' '  ' < /proc/1/cmdline; echo
touch /in-root 2>/dev/null && echo root-writable || echo root-read-only
echo hi > /scratch/out && echo scratch-written
touch /data/new 2>/dev/null && echo data-writable || echo data-read-only
cat /data/in.txt
echo bye > /dev/termination-log && echo ok > /dev/null && echo devices-ok
test -x /opt/venv/bin/kvpilot-operator && echo venv-ok
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ImageStore]:
    oci_images.cached(OPERATOR)
    oci_images.require_root_tools()
    unpack_dir = tmp_path_factory.mktemp("unpacked")
    found = ImageStore(checkout.cache_dir() / "images", unpack_dir)
    yield found
    found.shutdown()
    shutil.rmtree(unpack_dir, ignore_errors=True)


def unpacked(store: ImageStore, ref: images.ImageRef) -> Unpacked:
    """The store unpacks on a thread; ImageNotReadyError until it is done."""
    deadline = time.monotonic() + 300
    while True:
        try:
            return store.get(ref, "ghcr.io/kvpilot/operator")
        except ImageNotReadyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_container_runs_from_the_image_as_its_user_with_its_volumes(
    store: ImageStore, tmp_path: Path
) -> None:
    image = unpacked(store, images.ImageRef(OPERATOR.name, checkout.version(), None))
    assert (image.rootfs / "opt" / "venv").is_dir() and "kvpilot:x:10001" in image.passwd
    scratch, data = tmp_path / "scratch", tmp_path / "data"
    scratch.mkdir(mode=0o777)
    scratch.chmod(0o777)
    data.mkdir()
    (data / "in.txt").write_text("from-the-host\n")
    pod = {"metadata": {"name": "p-0"}, "spec": {"securityContext": {"fsGroup": 3000}}}
    container = {
        "name": "c",
        "command": ["sh", "-c", SCRIPT],
        "securityContext": {"readOnlyRootFilesystem": True, "runAsNonRoot": True},
        "volumeMounts": [
            {"name": "scratch", "mountPath": "/scratch"},
            {"name": "data", "mountPath": "/data", "readOnly": True},
        ],
    }
    message = tmp_path / "termination"
    message.write_text("")
    message.chmod(0o666)  # as the runner makes it (the kubelet's mode)
    mounts = images.volume_mounts(container, {"scratch": scratch, "data": data}, message)
    layers = images.Layers(image.rootfs, tmp_path / "container")
    plan = images.plan(pod, container, image.as_image(), layers, mounts, {"FROM_POD": "1"})
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan.to_json()))
    argv = images.unshare_argv("unshare", sys.executable, str(ENTER_SCRIPT), str(plan_file))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:4] == [str(UID), f"{UID} 3000", "/nonexistent", "/"]  # the image's user
    assert lines[4].startswith("sh -c")  # the command is PID 1 of its own namespace
    assert lines[5:] == ["root-read-only", "scratch-written", "data-read-only", "from-the-host",
                         "devices-ok", "venv-ok"]  # fmt: skip
    assert (scratch / "out").read_text() == "hi\n" and (scratch / "out").stat().st_uid == UID
    assert message.read_text() == "bye\n"
    # the mount points were made in this container's layer; the shared image is untouched
    assert not (image.rootfs / "scratch").exists() and (layers.container_dir / "upper").is_dir()


def test_an_image_that_is_not_cached_says_to_build_it(store: ImageStore) -> None:
    builds = r"not in the build cache .* this checkout builds version .* `make images IMAGE="
    with pytest.raises(ImagePullError, match=builds):
        store.get(images.ImageRef(OPERATOR.name, "0.0.0-absent", None), "ghcr.io/kvpilot/op")
    pinned = images.ImageRef(OPERATOR.name, checkout.version(), "sha256:" + "0" * 64)
    with pytest.raises(ImagePullError, match="not the digest the pod names"):
        store.get(pinned, "ghcr.io/kvpilot/operator@sha256:000")
