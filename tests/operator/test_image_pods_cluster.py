"""The dev cluster in images mode (`make cluster-up IMAGES=1`): a ModelDeployment on the `local`
pool whose pods — the fetch init container and the runtime — run from the CPU runtime image
`make images` cached (the local pool has no GPUs; hack/devcluster/imagesmode.py), not from the
host's venv, become Ready and answer a completion.

Its own dev cluster (the session's runs the host's venv); skipped where the images are not cached
or there is no root, as tests/packaging/test_images.py is. Images are unpacked into
$KVPILOT_IMAGES_UNPACK_DIR when set (kept for the next run), else into a temporary directory.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from hack.closedloop import apply_crds
from hack.devcluster import DevCluster
from hack.images import checkout
from hack.images.spec import CPU_DEBIAN_RELEASE, OPERATOR, RUNTIME_CPU, UID, VENV
from hack.podrunner.__main__ import UNPACK_DIR_ENV
from tests.support import oci_images
from tests.support.operator_cluster import (
    Operator,
    apply_doc,
    apply_secret,
    complete,
    pods,
    ready_check,
    tiny_llama_from,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def image_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    for spec in (OPERATOR, RUNTIME_CPU):  # what the cluster runs; the CUDA runtime may be absent
        oci_images.cached(spec)
    oci_images.require_root_tools()
    if os.environ.get("KUBECONFIG"):
        pytest.skip("images mode needs a dev cluster of its own, not the KUBECONFIG cluster")
    scratch = None
    if not os.environ.get(UNPACK_DIR_ENV):  # the pod runner inherits it
        scratch = tmp_path_factory.mktemp("unpacked")
        os.environ[UNPACK_DIR_ENV] = str(scratch)
    dev = DevCluster(tmp_path_factory.mktemp("devcluster-images"), images=True)
    try:
        dev.up()
        yield dev
    finally:
        dev.down()
        if scratch is not None:
            del os.environ[UNPACK_DIR_ENV]
            shutil.rmtree(scratch, ignore_errors=True)


def serving_pids(pod_ip: str) -> list[int]:
    """Host pids of runtime servers bound to `pod_ip` (`--host` is the pod runner's)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        serves = "serve" in argv and pod_ip in argv and any("kvpilot-runtime" in a for a in argv)
        # tini's own argv names the server's (`tini -- kvpilot-runtime serve ...`)
        if serves and (proc / "comm").read_text().strip() != "tini":
            found.append(int(proc.name))
    return found


def status_field(pid: int, name: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    raise AssertionError(f"/proc/{pid}/status has no {name}")


def test_a_runtime_pod_runs_from_the_image_and_answers(
    image_cluster: DevCluster, tmp_path: Path
) -> None:
    cluster, namespace = image_cluster, "default"
    apply_crds(cluster)
    operator = Operator(cluster, tmp_path / "operator.log")
    operator.start()
    try:
        apply_secret(cluster, namespace, "model-creds", {"HF_TOKEN": "unused-here"})
        md = tiny_llama_from("hf://kvpilot/tiny-llama", cluster, "model-creds")
        apply_doc(cluster, namespace, md)
        # a first start unpacks the runtime image (GBs) before its pod can run
        wait_for(ready_check(cluster, namespace, "tiny"), "tiny Ready", operator, timeout=600)
        (pod,) = pods(cluster, namespace, "tiny")
        # the operator beside the cluster names the CPU variant (DevCluster.env)
        images = {c["image"] for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]}
        assert images == {f"ghcr.io/kvpilot/runtime:{checkout.version()}-cpu"}
        (init,) = pod["status"]["initContainerStatuses"]
        assert init["name"] == "fetch-model" and init["state"]["terminated"]["exitCode"] == 0
        assert complete(pod)["usage"]["completion_tokens"] == 4
        (pid,) = serving_pids(pod["status"]["podIP"])
        root = os.readlink(f"/proc/{pid}/root")
        # chrooted into its own overlay of the image, as the image's user, the image's venv
        assert root.endswith("/containers/runtime/root"), root
        assert Path(f"/proc/{pid}/root{VENV}/bin/kvpilot-runtime").is_file()
        os_release = Path(f"/proc/{pid}/root/etc/os-release").read_text()
        assert f"VERSION_CODENAME={CPU_DEBIAN_RELEASE}" in os_release  # the CPU image's Debian
        assert Path(f"/proc/{pid}").stat().st_uid == UID
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        assert cmdline[0].startswith(f"{VENV}/bin/python"), cmdline
        # the operator writes args only: the image's ENTRYPOINT puts tini at PID 1, the server
        # is its child (tini forwards SIGTERM and reaps the server's children)
        parent = int(status_field(pid, "PPid"))
        assert Path(f"/proc/{parent}/comm").read_text().strip() == "tini"
        assert status_field(parent, "NSpid").split()[-1] == "1"
    finally:
        cluster.kubectl("delete", "modeldeployment", "tiny", "-n", namespace, "--wait=false",
                        check=False)  # fmt: skip
        operator.stop()
