"""This checkout and the build cache, as `make images` reads them: where the repository and the
cache lie, the version an image is tagged with, the commit and commit times its labels and
timestamps come from (git), and the project's pinned uv. An I/O adapter: every function here
runs git or uv or reads a file of the checkout.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tomllib
from collections.abc import Mapping
from pathlib import Path

from hack.images.spec import ImageSpec

ROOT = Path(__file__).resolve().parents[2]
# What an image is built from, besides the Debian archive: a change here is a new image.
INPUTS = (
    "pyproject.toml", "uv.lock", "README.md", "contract", "operator/kvpilot", "runtime/kvpilot",
    "gateway/kvpilot", "hack/images", "hack/uv-requirements.txt",
)  # fmt: skip


def cache_dir() -> Path:
    return Path(os.environ.get("KVPILOT_CACHE_DIR") or Path.home() / ".cache" / "kvpilot")


def version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def layout_dir(spec: ImageSpec, out: Path | None = None) -> Path:
    return (out or cache_dir() / "images" / version()) / spec.name


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH when set, else the commit time of HEAD: a rebuild of one commit gets the
    same timestamps (a dirty tree does too: the digest then differs by content alone)."""
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return int(os.environ["SOURCE_DATE_EPOCH"])
    out = subprocess.run(
        ["git", "log", "-1", "--format=%ct"], cwd=ROOT, check=True, capture_output=True, text=True
    )
    return int(out.stdout.strip())


def layer_epoch(paths: tuple[str, ...]) -> int:
    """SOURCE_DATE_EPOCH when set, else the commit time of the last commit that touched
    `paths`: a layer's timestamps follow its own inputs, not HEAD, or every commit would move
    every layer's bytes."""
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return int(os.environ["SOURCE_DATE_EPOCH"])
    out = subprocess.run(["git", "log", "-1", "--format=%ct", "--", *paths], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    return int(out) if out else source_date_epoch()


def revision() -> str:
    """HEAD's commit, with `-dirty` when the files an image is built from have changes."""
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    status = subprocess.run(
        ["git", "status", "--porcelain", "--", *INPUTS], cwd=ROOT, check=True, capture_output=True,
        text=True,
    ).stdout  # fmt: skip
    return f"{head}-dirty" if status.strip() else head


def uv_binary() -> Path:
    """The project's pinned uv (hack/uv.sh installs it on first use); copied into the root
    filesystem for the install and removed before packing."""
    subprocess.run(["bash", str(ROOT / "hack" / "uv.sh"), "--version"], check=True)
    pins = (ROOT / "hack" / "uv-requirements.txt").read_bytes()
    return cache_dir() / "tools" / f"uv-{hashlib.sha256(pins).hexdigest()[:16]}" / "bin" / "uv"


def uv(*args: str, env: Mapping[str, str] | None = None) -> None:
    subprocess.run(["bash", str(ROOT / "hack" / "uv.sh"), *args], cwd=ROOT, check=True, env=env)
