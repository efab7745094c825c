"""`pip install kvpilot[operator]` or `kvpilot[gateway]` brings no torch: the operator and
gateway images stay small, and their processes load no tensor library. Read from uv.lock, which
holds every package's locked dependencies (test_uv_lock checks it matches pyproject.toml)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def locked_packages() -> dict[str, dict[str, Any]]:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    return {package["name"]: package for package in lock["package"]}


def installed_with(extra: str, packages: dict[str, dict[str, Any]]) -> set[str]:
    """Every package `pip install kvpilot[extra]` installs (on any platform: markers are kept)."""
    wanted = [
        *packages["kvpilot"].get("dependencies", []),
        *packages["kvpilot"]["optional-dependencies"][extra],
    ]
    found: set[tuple[str, tuple[str, ...]]] = set()  # (package, its extras)
    while wanted:
        dependency = wanted.pop()
        name = dependency["name"]
        extras = tuple(dependency.get("extra", []))
        if (name, extras) in found:
            continue
        found.add((name, extras))
        package = packages[name]
        wanted.extend(package.get("dependencies", []))
        for each in extras:
            wanted.extend(package.get("optional-dependencies", {}).get(each, []))
    return {name for name, _ in found}


@pytest.mark.parametrize("extra", ["operator", "gateway"])
def test_the_extra_installs_no_torch(extra: str) -> None:
    installed = installed_with(extra, locked_packages())
    assert "torch" not in installed
    assert "kubernetes" in installed  # the walk reached the extra's own dependencies


def test_the_runtime_extra_does_install_torch() -> None:
    # the walk can find torch where it is: this test is the one above's control
    assert "torch" in installed_with("runtime", locked_packages())
