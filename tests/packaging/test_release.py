"""The release (issue 37 item 4): .github/workflows/release.yml passes actionlint, and every
version it publishes comes from one place — pyproject.toml's version for the chart, the image tags
and the operator's default runtime image; .python-version for the interpreter everywhere."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from hack import release
from hack.devcluster.versions import ACTIONLINT, HELM, HELM_VERSION
from hack.images import checkout
from hack.images.spec import DEBIAN_PYTHON, IMAGES
from kvpilot.operator.config import DEFAULT_RUNTIME_IMAGE
from tests.support.helm_chart import CHART, find, render, require

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
RELEASE = WORKFLOWS / "release.yml"


def actionlint(*paths: Path) -> subprocess.CompletedProcess[str]:
    binary = require(ACTIONLINT.path("actionlint"))
    argv = [str(binary), "-no-color", *map(str, paths)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def test_every_workflow_passes_actionlint() -> None:
    workflows = sorted(WORKFLOWS.glob("*.yml"))
    assert RELEASE in workflows
    done = actionlint(*workflows)
    assert done.returncode == 0, done.stdout + done.stderr


BROKEN_STEPS = [
    # (what is wrong, a step of the release job, what actionlint says)
    ("an output of a step that does not exist",
     "- run: echo ${{ steps.nope.outputs.version }}", 'property "nope" is not defined'),
    ("a misspelt action input",
     "- uses: actions/setup-python@v5\n        with:\n          python-version-fil: .python-ver",
     'input "python-version-fil" is not defined'),
    ("an untrusted value expanded into a script",
     "- run: echo ${{ github.event.head_commit.message }}", "potentially untrusted"),
]  # fmt: skip


@pytest.mark.parametrize(("why", "step", "message"), BROKEN_STEPS, ids=[b[0] for b in BROKEN_STEPS])
def test_actionlint_refuses_a_broken_step(
    tmp_path: Path, why: str, step: str, message: str
) -> None:
    """The check can fail: the release workflow with one bad step added is refused."""
    text = RELEASE.read_text()
    anchor = "    steps:\n"
    assert anchor in text
    broken = text.replace(anchor, f"{anchor}      {step}\n", 1)
    path = tmp_path / ".github" / "workflows" / "release.yml"
    path.parent.mkdir(parents=True)
    path.write_text(broken)
    done = actionlint(path)
    assert done.returncode != 0, why
    assert message in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("tag", "accepted"),
    [("v0.1.0", True), ("0.1.0", False), ("v0.1.1", False), ("v0.1.0-rc1", False), ("", False)],
)
def test_only_the_tag_of_pyprojects_version_releases(tag: str, accepted: bool) -> None:
    if accepted:
        release.check_tag(tag, "0.1.0")
    else:
        with pytest.raises(release.ReleaseError, match=r"pyproject\.toml"):
            release.check_tag(tag, "0.1.0")


def test_the_chart_carries_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    release.check_chart(chart, release.version())
    with pytest.raises(release.ReleaseError, match="appVersion"):
        release.check_chart({**chart, "appVersion": "9.9.9"}, release.version())


def test_the_release_cli_prints_the_outputs_and_refuses_another_tag() -> None:
    """What the workflow runs: key=value lines for $GITHUB_OUTPUT, or exit 1 saying why."""
    command = [sys.executable, "-m", "hack.release", "outputs", "--tag"]
    done = subprocess.run([*command, f"v{release.version()}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    outputs = dict(line.split("=", 1) for line in done.stdout.splitlines())
    assert outputs == {
        "version": release.version(),
        "python": DEBIAN_PYTHON,
        "helm": HELM_VERSION,
        "chart_repository": "oci://ghcr.io/kvpilot/charts",
    }
    refused = subprocess.run([*command, "v0.0.0-not-this"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, check=False)  # fmt: skip
    assert refused.returncode == 1 and "is not v" in refused.stderr


def test_images_are_pushed_where_the_chart_and_the_operator_pull_them() -> None:
    version = release.version()
    pushed = {layout.name: reference for layout, reference in release.image_references(version)}
    assert set(pushed) == set(IMAGES)
    assert pushed["kvpilot-runtime-cpu"] == f"{release.REGISTRY}/runtime:{version}-cpu"
    assert all(reference.endswith(f":{version}") for name, reference in pushed.items()
               if name != "kvpilot-runtime-cpu")  # fmt: skip
    assert checkout.version() == version  # the layouts' tag (`make images`)
    assert pushed["kvpilot-runtime"] == DEFAULT_RUNTIME_IMAGE
    helm = require(HELM.path("helm"))
    objects = render(helm)
    deployment = find(objects, "Deployment")
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == pushed["kvpilot-operator"]
    config = yaml.safe_load(find(objects, "ConfigMap")["data"]["config.yaml"])
    assert config["runtimeImage"] == pushed["kvpilot-runtime"]


def test_the_workflow_names_no_version_of_its_own() -> None:
    """Versions reach the workflow only through `python -m hack.release` and .python-version."""
    text = RELEASE.read_text()
    workflow = yaml.safe_load(text)
    steps = workflow["jobs"]["release"]["steps"]
    assert release.version() not in text and HELM_VERSION not in text
    setup_python = next(s for s in steps if s.get("uses", "").startswith("actions/setup-python"))
    assert setup_python["with"] == {"python-version-file": ".python-version"}
    setup_helm = next(s for s in steps if s.get("uses", "").startswith("azure/setup-helm"))
    assert setup_helm["with"]["version"] == "${{ steps.release.outputs.helm }}"
    runs = "\n".join(s.get("run", "") for s in steps)
    for command in (
        "python -m hack.release outputs",
        "python -m hack.release images",
        "make images",
        "cosign sign",
        "cosign attest",
        "syft scan",
        "helm push",
    ):
        assert command in runs, command  # fmt: skip
    assert workflow["jobs"]["release"]["permissions"]["id-token"] == "write"  # keyless signing
    # layouts are tagged <version>; a variant's reference tag (<version>-cpu) is not the layout's
    assert '"oci:$layout:$VERSION"' in runs


def test_the_python_version_is_one() -> None:
    pinned = release.python_version()
    assert re.fullmatch(r"3\.\d+", pinned)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["requires-python"] == f">={pinned}"
    assert pyproject["tool"]["mypy"]["python_version"] == pinned
    assert pyproject["tool"]["ruff"]["target-version"] == "py" + pinned.replace(".", "")
    assert pinned == DEBIAN_PYTHON  # the images' python3 (both Dockerfiles: test_images.py)
