"""The daemonless images' layers (hack/images/layers.py, layer_cache.py's packing, steps.py's
overlay): keys that move with each layer's own inputs and nothing else, reproducible layer
blobs, OCI documents that name them, and an overlay step that may add and change files but not
remove them."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from hack.images import layer_cache, layers, steps

INPUTS = {"requirements.txt": b"numpy==2.0\n", "customize.sh": b"echo venv\n"}
BASE = "sha256:base"


def test_a_layer_key_moves_with_each_of_its_inputs_and_nothing_else() -> None:
    same = layers.layer_key("venv", INPUTS, "sha256:base", 100)
    assert (
        layers.layer_key("venv", dict(reversed(list(INPUTS.items()))), "sha256:base", 100) == same
    )
    assert same.startswith("venv-") and len(same) == len("venv-") + 32
    moved = [
        layers.layer_key("venv", {**INPUTS, "requirements.txt": b"numpy==2.1\n"}, BASE, 100),
        layers.layer_key("venv", {**INPUTS, "extra": b""}, "sha256:base", 100),
        layers.layer_key("venv", INPUTS, "sha256:refreshed-base", 100),  # a new base below
        layers.layer_key("venv", INPUTS, None, 100),
        layers.layer_key("venv", INPUTS, "sha256:base", 101),  # another timestamp
        layers.layer_key("app", INPUTS, "sha256:base", 100),
        # bytes moved from one input to another
        layers.layer_key(
            "venv", {"requirements.txt": b"numpy==2.0\necho", "customize.sh": b" venv\n"},
            "sha256:base", 100,
        ),
    ]  # fmt: skip
    assert len({same, *moved}) == len(moved) + 1


def test_the_manifest_and_index_name_the_blobs_by_digest() -> None:
    stack = [layers.Layer("base", "sha256:aa", "sha256:da", 10, "b"),
             layers.Layer("app", "sha256:bb", "sha256:db", 20, "a")]  # fmt: skip
    config = layers.canonical_json({"b": 1, "a": [1, 2]})
    assert config == b'{"a":[1,2],"b":1}'
    manifest = layers.manifest_json(config, stack)
    assert manifest["config"] == {
        "mediaType": layers.CONFIG_MEDIA_TYPE,
        "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
        "size": len(config),
    }
    named = [(m["digest"], m["size"]) for m in manifest["layers"]]
    assert named == [("sha256:aa", 10), ("sha256:bb", 20)]
    assert {m["mediaType"] for m in manifest["layers"]} == {layers.LAYER_MEDIA_TYPE}
    manifest_bytes = layers.canonical_json(manifest)
    index = layers.index_json(manifest_bytes, "0.1.0")
    (entry,) = index["manifests"]
    assert entry["digest"] == layers.sha256_digest(manifest_bytes)
    assert entry["annotations"] == {layers.REF_NAME: "0.1.0"}
    layer = stack[0]
    assert layers.Layer.from_json(json.loads(json.dumps(layer.to_json()))) == layer


def make_tree(root: Path) -> Path:
    tree = root / "tree"
    (tree / "opt" / "venv" / "bin").mkdir(parents=True)
    (tree / "opt" / "venv" / "bin" / "tool").write_text("#!/bin/sh\n")
    (tree / "opt" / "venv" / "bin" / "tool").chmod(0o755)
    (tree / "opt" / "venv" / "a.py").write_text("x = 1\n")
    (tree / "dev").mkdir()
    (tree / "dev" / "null-ish").write_text("")
    os.symlink("a.py", tree / "opt" / "venv" / "b.py")
    return tree


def test_a_packed_tree_is_the_same_blob_whenever_it_is_packed(tmp_path: Path) -> None:
    """Files touched after the layer's timestamp pack the same (mtimes clamped); the gzip blob
    names neither a file nor a time; the diff_id is the tar's digest; excludes leave paths out."""
    tree = make_tree(tmp_path)
    epoch = 1_700_000_000
    first = layer_cache.pack_tree(tree, tmp_path / "1.tar.gz", epoch, ("./dev/*",))
    os.utime(tree / "opt" / "venv" / "a.py")  # now: later than the epoch
    second = layer_cache.pack_tree(tree, tmp_path / "2.tar.gz", epoch, ("./dev/*",))
    assert first == second
    digest, diff_id, size = first
    blob = (tmp_path / "1.tar.gz").read_bytes()
    assert digest == layers.sha256_digest(blob) and size == len(blob)
    assert diff_id == layers.sha256_digest(gzip.decompress(blob))
    with tarfile.open(tmp_path / "1.tar.gz") as archive:
        members = {m.name: m for m in archive.getmembers()}
    assert "./dev" in members and "./dev/null-ish" not in members
    assert members["."].mode == 0o755  # not a temporary directory's 0700
    assert all(m.mtime <= epoch and m.uid == 0 == m.gid for m in members.values())
    assert list(members) == sorted(members)
    (tree / "opt" / "venv" / "a.py").write_text("x = 2\n")
    assert layer_cache.pack_tree(tree, tmp_path / "3.tar.gz", epoch)[1] != diff_id


def root_with_overlayfs() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting an overlay needs root")
    probe = subprocess.run(["grep", "-qw", "overlay", "/proc/filesystems"], check=False)
    if probe.returncode != 0:
        pytest.skip("no overlayfs in this kernel")


def test_an_overlay_step_lands_in_the_upper_directory_and_may_not_remove(
    tmp_path: Path,
) -> None:
    """What a step adds or changes on the layers below is the upper directory (the next layer);
    a removal (an overlayfs whiteout) is refused, since a layer here never deletes."""
    root_with_overlayfs()
    lower = make_tree(tmp_path)
    (lower / "proc").mkdir()
    upper = tmp_path / "upper"
    with steps.overlay([lower], upper, tmp_path / "work") as merged:
        (merged / "opt" / "venv" / "new.py").write_text("y = 1\n")
        (merged / "opt" / "venv" / "a.py").write_text("x = 2\n")
        assert (merged / "proc" / "self").exists()  # a chroot's /proc
    added = sorted(str(p.relative_to(upper)) for p in upper.rglob("*") if p.is_file())
    assert added == ["opt/venv/a.py", "opt/venv/new.py"]
    assert (lower / "opt" / "venv" / "a.py").read_text() == "x = 1\n"  # the lower is untouched
    with (
        pytest.raises(SystemExit, match="removed files"),
        steps.overlay([lower], tmp_path / "upper2", tmp_path / "work2") as merged,
    ):
        (merged / "opt" / "venv" / "b.py").unlink()


def test_a_cached_tree_gets_the_mtimes_its_layer_holds(tmp_path: Path) -> None:
    """layer_cache.clamp_mtimes: what a step above copies up from a cached tree (its directories)
    carries the same mtimes whether the tree was built minutes ago or for an earlier commit."""
    tree = tmp_path / "tree"
    (tree / "opt" / "venv").mkdir(parents=True)
    old, new = tree / "opt" / "old", tree / "opt" / "venv" / "new"
    old.write_text("o")
    new.write_text("n")
    (tree / "link").symlink_to("/nonexistent")  # not followed
    epoch = 1_700_000_000
    os.utime(old, (epoch - 100, epoch - 100))
    layer_cache.clamp_mtimes(tree, epoch)
    mtimes = {p.relative_to(tree).as_posix(): int(p.lstat().st_mtime) for p in tree.rglob("*")}
    assert mtimes == {"opt": epoch, "opt/venv": epoch, "opt/old": epoch - 100,
                      "opt/venv/new": epoch, "link": epoch}  # fmt: skip
    assert int(tree.lstat().st_mtime) == epoch
