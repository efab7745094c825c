"""`pip install kvpilot[operator]` or `kvpilot[gateway]` brings no torch: the operator and gateway
images stay small, and their processes load no tensor library.

The wheel is built for real (uv with the pinned hatchling, as the editable install is) and its
metadata read: each extra's requirements as pip would see them, followed through uv.lock, which
holds every package's locked dependencies (test_uv_lock checks it matches pyproject.toml)."""

from __future__ import annotations

import subprocess
import tomllib
import zipfile
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            "bash",
            str(ROOT / "hack" / "uv.sh"),
            "build",
            "--wheel",
            "--out-dir",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("kvpilot-*.whl")
    return built


def requirements(wheel: Path, extra: str) -> list[Requirement]:
    """What pip installs with `kvpilot[extra]`, read from the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = HeaderParser().parsestr(archive.read(name).decode())
    wanted = []
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or marker.evaluate({"extra": extra, "sys_platform": "linux"}):
            wanted.append(requirement)
    return wanted


def installed_with(wanted: list[Requirement]) -> set[str]:
    """Every package those requirements install (on any platform: locked markers are kept)."""
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    packages: dict[str, dict[str, Any]] = {p["name"]: p for p in lock["package"]}
    todo = [(canonicalize_name(r.name), tuple(sorted(r.extras))) for r in wanted]
    found: set[tuple[str, tuple[str, ...]]] = set()  # (package, its extras)
    while todo:
        name, extras = todo.pop()
        if (name, extras) in found:
            continue
        found.add((name, extras))
        package = packages[name]
        dependencies = list(package.get("dependencies", []))
        for each in extras:
            dependencies += package.get("optional-dependencies", {}).get(each, [])
        todo += [(d["name"], tuple(sorted(d.get("extra", [])))) for d in dependencies]
    return {name for name, _ in found}


@pytest.mark.parametrize("extra", ["operator", "gateway"])
def test_the_extra_installs_no_torch(wheel: Path, extra: str) -> None:
    installed = installed_with(requirements(wheel, extra))
    assert "torch" not in installed
    assert "kubernetes" in installed  # the walk reached the extra's own dependencies


def test_the_runtime_extra_does_install_torch(wheel: Path) -> None:
    # the walk can find torch where it is: this test is the one above's control
    assert "torch" in installed_with(requirements(wheel, "runtime"))


def test_the_wheel_holds_the_contract(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for package in ("contract", "operator", "gateway", "runtime"):
        assert f"kvpilot/{package}/__init__.py" in names
