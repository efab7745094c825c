"""The daemonless images' layers (hack/images/layers.py, layer_cache.py's packing, steps.py's
overlay): keys that move with each layer's own inputs and nothing else, reproducible layer
blobs, OCI documents that name them, and an overlay step that may add and change files but not
remove them."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from hack.images import build, layer_cache, layers, oci_layout, steps

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


@pytest.mark.parametrize(
    ("entries", "blobs", "in_use", "gone_entries", "gone_blobs"),
    [
        ({}, [], set(), (), ()),
        ({"venv-new": "sha256:n", "venv-old": "sha256:o"}, ["sha256:n", "sha256:o"],
         {"sha256:n"}, ("venv-old",), ("sha256:o",)),
        # a blob no entry holds (its entry was removed by hand), an entry that lost its layer.json
        ({"app-x": "sha256:x", "base-broken": None}, ["sha256:x", "sha256:orphan"],
         {"sha256:x"}, ("base-broken",), ("sha256:orphan",)),
        # two keys of the same bytes (a timestamp moved, the tar did not): both stay while used
        ({"kernels-a": "sha256:k", "kernels-b": "sha256:k"}, ["sha256:k"], {"sha256:k"}, (), ()),
        # a digest in use that the cache does not hold (another cache built it): nothing to do
        ({"app-y": "sha256:y"}, ["sha256:y"], {"sha256:y", "sha256:elsewhere"}, (), ()),
        ({"app-y": "sha256:y"}, ["sha256:y"], set(), ("app-y",), ("sha256:y",)),
    ],
)  # fmt: skip
def test_the_cache_drops_the_entries_and_blobs_no_layer_in_use_needs(
    entries: dict[str, str | None], blobs: list[str], in_use: set[str],
    gone_entries: tuple[str, ...], gone_blobs: tuple[str, ...],
) -> None:  # fmt: skip
    assert layer_cache.unused(entries, blobs, in_use) == layer_cache.Unused(
        gone_entries, gone_blobs
    )


def cached_entry(cache: layer_cache.LayerCache, key: str, content: bytes) -> layers.Layer:
    """An entry as LayerCache.put leaves one: layer.json, its blob, an unpacked tree."""
    digest = layers.sha256_digest(content)
    cache.blob(digest).write_bytes(content)
    layer = layers.Layer(key.partition("-")[0], digest, digest, len(content), "test")
    (cache.root / key / "tree" / "opt").mkdir(parents=True)
    (cache.root / key / "layer.json").write_text(json.dumps(layer.to_json()))
    return layer


def write_layout(cache: layer_cache.LayerCache, path: Path, stack: list[layers.Layer]) -> None:
    config = {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    oci_layout.write_layout(path, cache, config, stack)


def test_a_build_prunes_the_layers_no_cached_layout_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """build.prune after an image is written: the layers of the layouts in the build cache (any
    version) and of those beside the new one (an --out directory) stay; an old venv's entry, a
    blob without an entry and a killed build's temporary directory go; the layouts keep every
    blob they name (hard links), and the apt cache and the lock stay."""
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path / "build-cache"))
    cache = layer_cache.LayerCache(tmp_path / "layers")
    base, venv, old_venv, app = (cached_entry(cache, key, key.encode())
                                 for key in ("base-1", "venv-2", "venv-1", "app-3"))  # fmt: skip
    orphan = cache.blob(layers.sha256_digest(b"orphan"))
    orphan.write_bytes(b"orphan")
    (cache.root / ".venv-2-killed" / "tree").mkdir(parents=True)
    (cache.root / "apt" / "bookworm").mkdir(parents=True)
    (cache.root / ".lock").write_text("")
    older_version = tmp_path / "build-cache" / "images" / "0.0.9" / "kvpilot-operator"
    write_layout(cache, older_version, [base])
    out = tmp_path / "out"
    write_layout(cache, out / "kvpilot-runtime-cpu", [base, venv])
    write_layout(cache, out / "kvpilot-runtime", [base, venv, app])
    build.prune(cache, out / "kvpilot-runtime")
    left = sorted(p.name for p in cache.root.iterdir())
    assert left == [".lock", "app-3", "apt", "base-1", "blobs", "venv-2"]
    assert not cache.blob(old_venv.digest).exists() and not orphan.exists()
    assert all(cache.blob(layer.digest).is_file() for layer in (base, venv, app))
    assert "entries 1, blobs 2, directories of killed builds 1" in capsys.readouterr().out
    assert oci_layout.blob(out / "kvpilot-runtime", app.digest).read_bytes() == b"app-3"
    # the layouts are what keeps a layer: with the --out layouts gone, theirs go at the next prune
    shutil.rmtree(out)
    write_layout(cache, out / "kvpilot-operator", [base])
    build.prune(cache, out / "kvpilot-operator")
    assert sorted(p.name for p in cache.root.iterdir()) == [".lock", "apt", "base-1", "blobs"]
    assert "entries 2, blobs 2, directories of killed builds 0" in capsys.readouterr().out
    assert [p.name for p in (cache.root / "blobs" / "sha256").iterdir()] == [
        base.digest.removeprefix("sha256:")
    ]


def test_no_layer_is_pruned_while_a_cached_layout_is_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A layout whose manifest cannot be read might still name any layer: keep them all."""
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path / "build-cache"))
    cache = layer_cache.LayerCache(tmp_path / "layers")
    base, old = cached_entry(cache, "base-1", b"base"), cached_entry(cache, "base-0", b"old")
    broken = tmp_path / "build-cache" / "images" / "0.1.0" / "kvpilot-operator"
    write_layout(cache, broken, [old])
    for path in (broken / "blobs" / "sha256").iterdir():
        path.unlink()
    write_layout(cache, tmp_path / "out" / "kvpilot-runtime", [base])
    build.prune(cache, tmp_path / "out" / "kvpilot-runtime")
    assert "layer cache not pruned: a cached layout is unreadable" in capsys.readouterr().out
    assert cache.blob(old.digest).is_file() and (cache.root / "base-0" / "tree").is_dir()
