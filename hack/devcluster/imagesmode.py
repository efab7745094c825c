"""Images mode's images (`up --images`): which of the images `make images` cached the dev
cluster runs. The local pool has no GPUs, so its runtime pods run the CPU variant, as on a
CPU-only cluster; the operator beside the cluster names it through KVPILOT_RUNTIME_IMAGE, the
setting (the chart's `config.runtimeImage`, `config.runtimeVariant`) a CPU-only cluster's user
sets."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

# `from hack import release`, not its names: hack.release imports hack.devcluster (its versions),
# so either package may be the one still initialising when the other imports it.
from hack import release
from hack.devcluster.errors import DevClusterError
from hack.images import checkout as images_checkout
from hack.images.spec import IMAGES, OPERATOR, RUNTIME, RUNTIME_CPU

# In the state directory while the cluster is up in images mode: the runtime image's reference
RUNTIME_IMAGE_FILE = "runtime-image"
OPERATOR_ENV = "KVPILOT_RUNTIME_IMAGE"  # the operator's own setting (operator/config.py)


def choose_runtime(cached: Collection[str], layouts: Mapping[str, Path]) -> tuple[str, str | None]:
    """The runtime image (its name) the cluster's pods run, and a line to print when it is not
    the CPU variant. The CUDA variant serves on CPU too, so with only it cached the cluster still
    runs, saying so; without the operator's image or either runtime it refuses (at `up`, not as
    pods stuck in ErrImagePull), naming the layouts to build."""
    missing = [] if OPERATOR.name in cached else [str(layouts[OPERATOR.name])]
    if RUNTIME_CPU.name not in cached and RUNTIME.name not in cached:
        missing.append(f"{layouts[RUNTIME_CPU.name]} (or {layouts[RUNTIME.name]})")
    if missing:
        raise DevClusterError(
            "images mode runs the local pool's pods from the images `make images` builds;"
            f" not cached: {', '.join(missing)}: run `make images` (as root) first"
        )
    if RUNTIME_CPU.name in cached:
        return RUNTIME_CPU.name, None
    note = (
        f"==> images mode: {RUNTIME_CPU.name} is not cached ({layouts[RUNTIME_CPU.name]}): the"
        f" runtime pods run {RUNTIME.name}, the CUDA variant (it serves on CPU too); `make images"
        f" IMAGE={RUNTIME_CPU.name}` (as root) builds what a CPU-only cluster runs"
    )
    return RUNTIME.name, note


def cached_images() -> set[str]:
    return {
        name
        for name, spec in IMAGES.items()
        if (images_checkout.layout_dir(spec) / "index.json").is_file()
    }


def runtime_image() -> tuple[str, str]:
    """The runtime image's name and released reference for `up --images`, printing why when it is
    not the CPU variant; DevClusterError when the images are not cached."""
    layouts = {name: images_checkout.layout_dir(spec) for name, spec in IMAGES.items()}
    name, note = choose_runtime(cached_images(), layouts)
    if note:
        print(note, flush=True)
    references = {
        layout.name: reference
        for layout, reference in release.image_references(images_checkout.version())
    }
    return name, references[name]


def operator_env(state_dir: Path) -> dict[str, str]:
    """What an operator run beside the cluster needs to name the images mode's runtime image."""
    try:
        return {OPERATOR_ENV: (state_dir / RUNTIME_IMAGE_FILE).read_text().strip()}
    except FileNotFoundError:
        return {}
