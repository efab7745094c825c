"""`make images`: the OCI images of hack/images/spec.py, built without a container engine.

    python -m hack.images [kvpilot-operator] [kvpilot-runtime] [kvpilot-runtime-cpu] [--out DIR]

Per image, a stack of layers, each cached under a key of its own inputs (hack/images/layers.py)
in ${KVPILOT_IMAGE_LAYER_CACHE:-<build cache>/layers} and rebuilt only when that key moves:
  base     mmdebstrap of Debian (essential variant plus the spec's packages) and the non-root user;
           the .debs stay in the cache's apt/<release> for the next base, not in the image
  venv     the locked virtualenv, installed from uv.lock by uv running inside the base (chroot on
           an overlay: the overlay's upper directory is the layer)
  kernels  the paged-attention kernels (runtimes), built by the image's torch
  app      the kvpilot wheel, into that venv: the only layer a source change rebuilds
Each layer is a reproducible tar (sorted entries, numeric owners, mtimes clamped to a timestamp
of its own inputs; no device nodes), gzip'd without a name or time; the OCI layout's config,
manifest and index are written here as canonical JSON. The same commit, uv.lock and Debian
archive state give the same manifest digest, from a warm cache or a cold one. After each image
the cache drops the layers no cached layout uses (any version's, and those beside an --out
layout). `--refresh` rebuilds every layer (the base from today's archive: security updates).
Needs root (mmdebstrap --mode=root, chroot, overlayfs, a bind mount of uv's cache).
Layouts land under ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/images/<version>/<image>, tag <version>.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hack.images import spec as specs
from hack.images.builders import app_layer, base_layer, kernel_layer, venv_layer, write_requirements
from hack.images.checkout import cache_dir, layout_dir, revision, source_date_epoch, uv_binary
from hack.images.layer_cache import LAYER_CACHE_ENV, LayerCache, layer_cache_dir
from hack.images.layers import Layer, rfc3339
from hack.images.oci_layout import (
    cached_recipe_digest,
    layer_digests,
    spec_config,
    summary,
    write_layout,
)
from hack.images.recipe import tree_recipe_digest
from hack.images.spec import ImageSpec
from hack.images.steps import build_wheel

# The build, module by module: layers.py (pure: keys, the mmdebstrap and tar argv, the OCI
# documents), checkout.py (git, uv, the cache's paths), recipe.py (the digest --if-changed
# compares, the locked pins), layer_cache.py (cached layers, packing), steps.py (what runs as
# root: overlay mounts, chroot steps, kernels, the wheel), builders.py (each layer's inputs and
# build), oci_layout.py (the layout written and read); this module assembles an image.
TOOLS = ("mmdebstrap", "umoci")


@contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # another clone building the same image: wait
        yield


def build(
    spec: ImageSpec, out: Path | None = None, layer_cache: Path | None = None,
    refresh: bool = False,
) -> Path:  # fmt: skip
    """Builds `spec` into its layout (replacing an older one) from the layer cache's layers
    whose keys match, building the others; returns the layout's path."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"make images needs {' '.join(missing)}: run `make system-deps` as root")
    if os.geteuid() != 0:
        raise SystemExit("make images needs root (mmdebstrap --mode=root, chroot, mount)")
    layout = layout_dir(spec, out)
    layout.parent.mkdir(parents=True, exist_ok=True)
    epoch = source_date_epoch()
    # The tree the wheel is built from, named before it is built: a commit made while an image
    # builds (minutes) must not be the label of sources it does not hold.
    source = revision()
    cache = LayerCache(layer_cache or layer_cache_dir(), refresh)
    with locked(cache.root / ".lock"):
        with tempfile.TemporaryDirectory(dir=cache.root, prefix=f".{spec.name}-") as work:
            stack = build_layers(spec, cache, epoch, Path(work))
        config = spec_config(spec, rfc3339(epoch), source, stack)
        with tempfile.TemporaryDirectory(dir=layout.parent, prefix=f".{spec.name}-") as new:
            write_layout(Path(new) / "layout", cache, config, stack)
            shutil.rmtree(layout, ignore_errors=True)
            (Path(new) / "layout").rename(layout)
        prune(cache, layout)  # the work directory is gone: only a killed build's are left
    return layout


def build_layers(spec: ImageSpec, cache: LayerCache, epoch: int, work: Path) -> list[Layer]:
    """`spec`'s stack, each layer from the cache when its key is there, else built in `work`."""
    stage = work / "stage"
    stage.mkdir()
    shutil.copy2(uv_binary(), stage / "uv")
    write_requirements(spec, stage)
    wheel = build_wheel(stage, epoch)
    base = base_layer(spec, cache)
    venv = venv_layer(spec, cache, base, stage, work)
    stack = [base[0], venv[0]]
    if spec.kernel_levels:
        stack.append(kernel_layer(spec, cache, venv[0], stage, wheel, work))
    stack.append(app_layer(spec, cache, venv, base[1], stage, wheel, epoch, work))
    return stack


def prune(cache: LayerCache, layout: Path) -> None:
    """Drops the cached layers no kept layout uses: those of the layout just written, of the
    layouts beside it (the other images of its version or --out) and of every version's in
    the build cache. Without this the cache grew by each old venv layer, tree and blob (~9 GB
    for the CUDA runtime's) until the disk filled."""
    roots = {layout.parent, *(cache_dir() / "images").glob("*")}
    kept = sorted({index.parent for root in roots for index in root.glob("*/index.json")})
    try:
        in_use = layer_digests(kept)
    except (OSError, ValueError, KeyError) as error:
        print(f"    layer cache not pruned: a cached layout is unreadable ({error!r})")
        return
    print(cache.prune(in_use), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hack.images", description=__doc__)
    parser.add_argument("images", nargs="*", help=f"of {', '.join(specs.IMAGES)} (default: all)")
    parser.add_argument("--out", type=Path, help="layouts go here instead of the build cache")
    parser.add_argument(
        "--if-changed",
        action="store_true",
        help="build only images whose cached layout was made from another recipe (Dockerfiles,"
        " uv.lock, pyproject.toml, hack/images): what CI runs before the tests",
    )
    parser.add_argument(
        "--refresh",
        action="store_true",
        help="rebuild every layer, the cached ones too: the Debian base with today's archive"
        " (security updates), the venv on it",
    )
    parser.add_argument(
        "--layer-cache",
        type=Path,
        help=f"the layer cache (default: ${LAYER_CACHE_ENV} or <build cache>/layers)",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.images) - set(specs.IMAGES))
    if unknown:
        parser.error(f"no image {', '.join(unknown)}: the images are {', '.join(specs.IMAGES)}")
    for name in args.images or list(specs.IMAGES):
        cached = layout_dir(specs.IMAGES[name], args.out)
        recipe = tree_recipe_digest(specs.IMAGES[name])
        if args.if_changed and cached_recipe_digest(cached) == recipe:
            print(f"==> {name}: the cached image has this recipe, not rebuilt\n    {cached}")
            continue
        print(f"==> building {name}", flush=True)
        layout = build(specs.IMAGES[name], args.out, args.layer_cache, args.refresh)
        print(f"==> {summary(layout)}\n    {layout}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
