"""Images mode's images (hack/devcluster/imagesmode.py): the local pool has no GPUs, so `up
--images` runs the CPU runtime image when it is cached, the CUDA one (saying so) when only it
is, and refuses without the operator's image or any runtime; the operators started beside the
cluster read the choice through KVPILOT_RUNTIME_IMAGE."""

from __future__ import annotations

from pathlib import Path

import pytest

from hack.devcluster import DevCluster, imagesmode
from hack.devcluster.errors import DevClusterError
from hack.images import checkout
from hack.podrunner import images
from hack.podrunner.__main__ import parse_args
from kvpilot.operator import config

OPERATOR, CUDA, CPU = "kvpilot-operator", "kvpilot-runtime", "kvpilot-runtime-cpu"
LAYOUTS = {name: Path("/cache/images/0.1.0") / name for name in (OPERATOR, CUDA, CPU)}


@pytest.mark.parametrize(
    ("cached", "runtime", "says"),
    [
        ({OPERATOR, CUDA, CPU}, CPU, None),
        ({OPERATOR, CPU}, CPU, None),
        ({OPERATOR, CUDA}, CUDA, f"{CPU} is not cached (/cache/images/0.1.0/{CPU})"),
    ],
)
def test_the_cpu_runtime_when_cached_else_the_cuda_one_saying_so(
    cached: set[str], runtime: str, says: str | None
) -> None:
    name, note = imagesmode.choose_runtime(cached, LAYOUTS)
    assert name == runtime
    if says is None:
        assert note is None
    else:
        assert note is not None and says in note and f"make images IMAGE={CPU}" in note


@pytest.mark.parametrize(
    ("cached", "missing"),
    [
        ({CUDA, CPU}, [f"/cache/images/0.1.0/{OPERATOR}"]),
        ({OPERATOR}, [f"/cache/images/0.1.0/{CPU} (or /cache/images/0.1.0/{CUDA})"]),
        (set(), [f"/cache/images/0.1.0/{OPERATOR}", f"/cache/images/0.1.0/{CPU} (or"]),
    ],
)
def test_without_the_operator_or_any_runtime_up_refuses(
    cached: set[str], missing: list[str]
) -> None:
    with pytest.raises(DevClusterError, match="run `make images` \\(as root\\) first") as raised:
        imagesmode.choose_runtime(cached, LAYOUTS)
    assert all(path in str(raised.value) for path in missing)


def test_the_runtime_image_is_the_released_reference_images_mode_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runtime_image() names what the release pushes, which the pod runner maps back to the
    cached layout it chose; the operator's own config parser reads it from the cluster's env."""
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path))
    for name in (OPERATOR, CPU):
        layout = tmp_path / "images" / checkout.version() / name
        layout.mkdir(parents=True)
        (layout / "index.json").write_text("{}")
    name, reference = imagesmode.runtime_image()
    assert (name, reference) == (CPU, f"ghcr.io/kvpilot/runtime:{checkout.version()}-cpu")
    assert images.parse_reference(reference, "") == images.ImageRef(CPU, checkout.version(), None)
    cluster = DevCluster(tmp_path / "state", images=True)
    assert imagesmode.OPERATOR_ENV not in cluster.env  # not up in images mode
    cluster.state_dir.mkdir()
    cluster.runtime_image_file.write_text(reference + "\n")
    parsed = config.from_mapping({}, cluster.env)
    assert parsed.runtime_image == reference


def test_the_pod_runner_pre_pulls_what_the_cluster_runs() -> None:
    args = parse_args(["--kubeconfig=k", "--log-dir=l", "--images", f"--pre-pull={CPU}"])
    assert args.pre_pull == [CPU]
    with pytest.raises(SystemExit):  # only images `make images` builds
        parse_args(["--kubeconfig=k", "--log-dir=l", "--pre-pull=busybox"])
