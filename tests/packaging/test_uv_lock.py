"""uv.lock pins every dependency; hack/lock_check.sh (the check `make lock-check` and every `make`
target's set-up run) fails, saying what to do, when pyproject.toml's dependencies and the lock
disagree. Runs the real check (uv, offline) on the real files and on edited copies of them."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCK_CHECK = ROOT / "hack" / "lock_check.sh"


def lock_check(project: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(LOCK_CHECK), str(project)],
        capture_output=True,
        text=True,
        timeout=300,  # the first run on a machine installs uv
        check=False,
    )


def test_the_committed_lock_matches_pyproject() -> None:
    result = lock_check(ROOT)
    assert result.returncode == 0, result.stderr


# (what changed in pyproject.toml, text before, text after, whether the lock is still current)
EDITS = [
    ("a dependency added", '"ruff>=0.6",', '"ruff>=0.6",\n    "xgrammar>=0.1",', False),
    ("a dependency removed", '"tqdm>=4.66",\n', "", False),
    ("a bound tightened", '"pytest>=8.0"', '"pytest>=8.1"', False),
    ("the build backend's pin moved", '"hatchling==1.33.0"', '"hatchling==1.32.0"', False),
    ("tool config only", "line-length = 100", "line-length = 99", True),
]


@pytest.mark.parametrize(
    ("before", "after", "still_current"),
    [edit[1:] for edit in EDITS],
    ids=[edit[0] for edit in EDITS],
)
def test_the_check_fails_exactly_when_dependencies_change(
    tmp_path: Path, before: str, after: str, still_current: bool
) -> None:
    shutil.copy(ROOT / "uv.lock", tmp_path / "uv.lock")
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert before in pyproject  # else the edit below would silently change nothing
    (tmp_path / "pyproject.toml").write_text(pyproject.replace(before, after, 1))

    result = lock_check(tmp_path)

    assert (result.returncode == 0) is still_current, result.stderr
    if not still_current:
        assert "uv.lock does not match the dependencies in pyproject.toml" in result.stderr
        assert "make lock" in result.stderr


def test_torch_comes_from_pypi_with_a_linux_x86_64_cpython_311_wheel() -> None:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    (torch,) = [p for p in lock["package"] if p["name"] == "torch"]
    assert torch["source"] == {"registry": "https://pypi.org/simple"}
    wheels = [Path(w["url"]).name for w in torch["wheels"]]
    assert any(re.search(r"-cp311-cp311-manylinux\w*_x86_64\.whl$", w) for w in wheels), wheels


def test_uv_itself_is_pinned_to_one_version_with_hashes() -> None:
    text = (ROOT / "hack" / "uv-requirements.txt").read_text()
    requirements = re.findall(r"^(\S+==\S+)", text, flags=re.MULTILINE)
    assert len(requirements) == 1 and requirements[0].startswith("uv=="), requirements
    assert re.findall(r"--hash=sha256:[0-9a-f]{64}", text)


def test_a_pyproject_uv_cannot_read_is_reported_in_uvs_words(tmp_path: Path) -> None:
    shutil.copy(ROOT / "uv.lock", tmp_path / "uv.lock")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text() + "\n[oops\n")

    result = lock_check(tmp_path)

    assert result.returncode == 1
    assert "uv could not check uv.lock against pyproject.toml" in result.stderr
    assert "TOML parse error" in result.stderr
