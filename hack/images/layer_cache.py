"""The layer cache: packed layers by key (hack/images/layers.py's `layer_key`), their blobs and
the unpacked trees the layers above are built on, and the packing itself (`pack_tree`: a
reproducible tar, gzip'd in-process). What decides a key, and when an entry is built, is
hack/images/builders.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import zlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hack.images import layers
from hack.images.checkout import cache_dir

LAYER_CACHE_ENV = "KVPILOT_IMAGE_LAYER_CACHE"


def layer_cache_dir() -> Path:
    return Path(os.environ.get(LAYER_CACHE_ENV) or cache_dir() / "layers")


class LayerCache:
    """Packed layers by key under `root`: <key>/layer.json (a layers.Layer), <key>/tree (the
    unpacked files of the base and venv layers, the lower directories the layers above them are
    built on), blobs/sha256/<hex>; apt/<release>, the .debs mmdebstrap downloaded.
    `refresh`: every layer is rebuilt once, then its new entry is used. Callers hold the lock
    (build.locked on root/.lock) while they read, add or prune."""

    def __init__(self, root: Path, refresh: bool = False) -> None:
        self.root = root
        self.refresh = refresh
        self.rebuilt: set[str] = set()
        (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)

    def blob(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / digest.removeprefix("sha256:")

    def tree(self, key: str) -> Path:
        return self.root / key / "tree"

    def settled_tree(self, key: str, epoch: int) -> Path:
        """`key`'s cached tree with the mtimes its layer's tar holds (clamped to `epoch`), once.
        A step above copies up the directories it writes into (/opt/venv, ...) with their
        mtimes: a tree built minutes ago and one reused from an earlier commit's build would
        otherwise give the layer above different bytes."""
        tree = self.tree(key)
        marker = self.root / key / "mtimes-clamped"
        if not marker.is_file():
            clamp_mtimes(tree, epoch)
            marker.write_text(f"{epoch}\n")
        return tree

    def apt_archives(self, release: str) -> Path:
        path = self.root / "apt" / release
        (path / "partial").mkdir(parents=True, exist_ok=True)
        return path

    def get(self, key: str, with_tree: bool) -> layers.Layer | None:
        entry = self.root / key / "layer.json"
        if (self.refresh and key not in self.rebuilt) or not entry.is_file():
            return None
        layer = layers.Layer.from_json(json.loads(entry.read_text()))
        if not self.blob(layer.digest).is_file() or (with_tree and not self.tree(key).is_dir()):
            return None
        return layer

    @contextmanager
    def new_entry(self, key: str) -> Iterator[Path]:
        """A directory to build `key`'s entry in, renamed into place when the body succeeds."""
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{key}-"))
        try:
            yield tmp
            shutil.rmtree(self.root / key, ignore_errors=True)
            tmp.rename(self.root / key)
            self.rebuilt.add(key)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def put(self, entry: Path, name: str, tree: Path, epoch: int, excludes: tuple[str, ...] = ()
            ) -> layers.Layer:  # fmt: skip
        """Packs `tree` as layer `name` into the cache's blobs and writes entry/layer.json."""
        tmp_blob = entry / "blob.tar.gz"
        digest, diff_id, size = pack_tree(tree, tmp_blob, epoch, excludes)
        tmp_blob.replace(self.blob(digest))
        layer = layers.Layer(name, digest, diff_id, size, layers.CREATED_BY[name])
        (entry / "layer.json").write_text(json.dumps(layer.to_json(), indent=2) + "\n")
        print(f"    layer {name}: {digest} {size / 1e6:.1f} MB", flush=True)
        return layer

    def prune(self, in_use: set[str]) -> str:
        """Removes what no layer digest in `in_use` needs: entries of other layers (a venv
        layer's tree and blob are gigabytes, and each change of its pins or base left another),
        blobs no entry holds, and the temporary directories of a build that was killed (the
        lock is held: no build is running). The layouts keep their own hard links to the blobs
        they name, so none of them loses a layer. Returns a line saying what went."""
        free_before = shutil.disk_usage(self.root).free
        gone = unused(self._entry_digests(), self._blob_digests(), in_use)
        for key in gone.entries:
            shutil.rmtree(self.root / key)
        for digest in gone.blobs:
            self.blob(digest).unlink()
        leftovers = [p for p in self.root.glob(".*") if p.is_dir() and not p.is_symlink()]
        for path in leftovers:
            shutil.rmtree(path)
        freed = max(0, shutil.disk_usage(self.root).free - free_before)
        return (
            f"    layer cache pruned of the layers no cached image uses ({freed / 1e9:.1f} GB"
            f" freed): entries {len(gone.entries)}, blobs {len(gone.blobs)}, directories of"
            f" killed builds {len(leftovers)}"
        )

    def _entry_digests(self) -> dict[str, str | None]:
        """Each entry's layer digest by key; None for an entry whose layer.json is unreadable."""
        digests: dict[str, str | None] = {}
        for path in self.root.iterdir():
            if not path.is_dir() or path.name.startswith(".") or path.name in ("blobs", "apt"):
                continue
            try:
                layer = json.loads((path / "layer.json").read_text())
                digests[path.name] = str(layer["digest"])
            except (OSError, ValueError, KeyError, TypeError):
                digests[path.name] = None
        return digests

    def _blob_digests(self) -> list[str]:
        return [f"sha256:{path.name}" for path in (self.root / "blobs" / "sha256").iterdir()]


@dataclass(frozen=True)
class Unused:
    entries: tuple[str, ...]  # keys
    blobs: tuple[str, ...]  # digests


def unused(
    entry_digests: Mapping[str, str | None], blobs: Iterable[str], in_use: set[str]
) -> Unused:
    """The entries (key -> their layer's digest, None when unreadable) and blobs of a cache
    that no layer in `in_use` needs. An entry is kept by its digest alone: two keys of the same
    bytes (a layer rebuilt under a new timestamp to the same tar) both stay while it is used."""
    entries = tuple(sorted(key for key, digest in entry_digests.items() if digest not in in_use))
    return Unused(entries, tuple(sorted(digest for digest in blobs if digest not in in_use)))


def clamp_mtimes(tree: Path, epoch: int) -> None:
    """Every entry of `tree` newer than `epoch` gets `epoch` as its mtime (as tar's
    --clamp-mtime packs it); symlinks themselves, not what they point at."""
    for directory, dirs, files in os.walk(tree):
        for name in (*dirs, *files):
            path = os.path.join(directory, name)
            if os.lstat(path).st_mtime > epoch:
                os.utime(path, (epoch, epoch), follow_symlinks=False)
    if tree.lstat().st_mtime > epoch:
        os.utime(tree, (epoch, epoch), follow_symlinks=False)


def pack_tree(
    tree: Path, blob_path: Path, epoch: int, excludes: tuple[str, ...] = ()
) -> tuple[str, str, int]:
    """`tree` as a gzip'd tar at `blob_path`: (blob digest, diff_id, blob size). The gzip header
    has no name and mtime 0, so the blob follows the tar alone."""
    tree.chmod(0o755)  # the layer's "./": a temporary directory is 0700, the image's / is not
    diff, compressed = hashlib.sha256(), hashlib.sha256()
    deflate = zlib.compressobj(6, zlib.DEFLATED, 31)
    size = 0
    with (
        subprocess.Popen(layers.tar_command(tree, epoch, excludes), stdout=subprocess.PIPE) as tar,
        blob_path.open("wb") as out,
    ):
        assert tar.stdout is not None
        while chunk := tar.stdout.read(1 << 20):
            diff.update(chunk)
            data = deflate.compress(chunk)
            compressed.update(data)
            out.write(data)
            size += len(data)
        data = deflate.flush()
        compressed.update(data)
        out.write(data)
        size += len(data)
    if tar.returncode != 0:
        raise SystemExit(f"tar of {tree} failed ({tar.returncode})")
    return f"sha256:{compressed.hexdigest()}", f"sha256:{diff.hexdigest()}", size
