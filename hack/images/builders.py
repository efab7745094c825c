"""The per-layer builders of an image's stack (base, venv, kernels, app): what each layer's key
is made of (its inputs, the layer below, its timestamp) and, on a cache miss, the steps that
build it into a new cache entry.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from hack.images import layers
from hack.images import spec as specs
from hack.images.checkout import ROOT, layer_epoch
from hack.images.layer_cache import LayerCache
from hack.images.layers import COMPILE_PYC, HOOK
from hack.images.recipe import locked_requirements
from hack.images.spec import ImageSpec
from hack.images.steps import build_kernel, build_stage_kernels, overlay, step_env, unmount_all

# The files each cached layer is made from, besides what its key names directly: the last commit
# that touched them gives the layer's timestamp (layer_epoch), so a rebuild of the same inputs
# from a cold cache packs the same bytes as the warm cache holds. The build's own modules are
# not among them: a change to those rebuilds the images through the recipe digest (recipe.py)
# and moves no layer's timestamp.
BASE_FILES = ("hack/images/spec.py", "hack/images/customize.sh")
VENV_FILES = (
    *BASE_FILES,
    "hack/images/compile_pyc.py",
    "uv.lock",
    "pyproject.toml",
    "hack/uv-requirements.txt",
)
KERNEL_SOURCES = (
    "runtime/kvpilot/runtime/layers/paged_kernel.py",
    "runtime/kvpilot/runtime/layers/paged_decode.cpp",
    "runtime/kvpilot/runtime/layers/int4_tiles.cpp",
    "runtime/kvpilot/runtime/layers/lora_add.cpp",
    "runtime/kvpilot/runtime/layers/dense_rows.cpp",
    "runtime/kvpilot/runtime/layers/float_convert.h",
    "runtime/kvpilot/runtime/layers/float_lanes.h",
)
KERNEL_FILES = (*VENV_FILES, *KERNEL_SOURCES)
# Nothing below /dev ships (the container runtime makes it; nodes in a layer break rootless).
BASE_EXCLUDES = ("./dev/*",)


def base_inputs(spec: ImageSpec) -> dict[str, bytes]:
    """What decides the base layer: mmdebstrap's arguments (packages, suites, mirrors, dpkg's
    excludes; the paths that vary by machine as placeholders), the user step and its values."""
    argv = layers.mmdebstrap_command(spec, Path("TREE"), Path("APT"), Path("customize.sh"))
    env = step_env(spec, Path("STAGE"), 0)
    user = [env[key] for key in ("KVPILOT_PASSWD_LINE", "KVPILOT_GROUP_LINE",
                                 "KVPILOT_OWNED_DIRS", "KVPILOT_UID")]  # fmt: skip
    return {"mmdebstrap": "\0".join(argv).encode(), "user": "\0".join(user).encode(),
            "customize.sh": HOOK.read_bytes()}  # fmt: skip


def base_layer(spec: ImageSpec, cache: LayerCache) -> tuple[layers.Layer, Path]:
    epoch = layer_epoch(BASE_FILES)
    key = layers.layer_key("base", base_inputs(spec), None, epoch)
    layer = cache.get(key, with_tree=True)
    if layer is None:
        print(f"    building layer base ({key})", flush=True)
        apt = cache.apt_archives(spec.debian_release)
        with cache.new_entry(key) as entry:
            tree = entry / "tree"
            env = step_env(spec, Path("/nonexistent"), epoch)
            try:
                subprocess.run(layers.mmdebstrap_command(spec, tree, apt), env=env, check=True)
            finally:  # a failed mmdebstrap may leave the apt cache mounted in the tree
                unmount_all(tree / "var/cache/apt/archives")
            layer = cache.put(entry, "base", tree, epoch, BASE_EXCLUDES)
    return layer, cache.settled_tree(key, epoch)


def write_requirements(spec: ImageSpec, stage: Path) -> None:
    """The spec's locked pins into stage/requirements.txt, without uv's header, which names the
    output's path: the venv layer's key reads this file."""
    (stage / "requirements.txt").write_text(locked_requirements(spec))


def venv_inputs(spec: ImageSpec, stage: Path) -> dict[str, bytes]:
    env = step_env(spec, stage, 0)
    flags = [env[key] for key in ("KVPILOT_COMPILE_BYTECODE", "KVPILOT_SYSTEM_SITE_PACKAGES",
                                  "VENV")]  # fmt: skip
    return {"requirements.txt": (stage / "requirements.txt").read_bytes(),
            "uv": (ROOT / "hack" / "uv-requirements.txt").read_bytes(),
            "customize.sh": HOOK.read_bytes(), "compile_pyc.py": COMPILE_PYC.read_bytes(),
            "flags": "\0".join(flags).encode()}  # fmt: skip


def venv_layer(
    spec: ImageSpec, cache: LayerCache, base: tuple[layers.Layer, Path], stage: Path, work: Path
) -> tuple[layers.Layer, Path]:
    epoch = layer_epoch(VENV_FILES)
    key = layers.layer_key("venv", venv_inputs(spec, stage), base[0].digest, epoch)
    layer = cache.get(key, with_tree=True)
    if layer is None:
        print(f"    building layer venv ({key})", flush=True)
        with cache.new_entry(key) as entry:
            tree = entry / "tree"
            with overlay([base[1]], tree, work / "venv-overlay") as root:
                env = step_env(spec, stage, epoch)
                subprocess.run(["bash", str(HOOK), "venv", str(root)], env=env, check=True)
            layer = cache.put(entry, "venv", tree, epoch)
    return layer, cache.settled_tree(key, epoch)


def kernel_inputs(spec: ImageSpec) -> dict[str, bytes]:
    """The kernels' sources and levels, and what builds them: the build stage's packages, or
    (built by this venv's torch) the host's Python, torch and CPU flags, which pick the levels
    the compiler can target and test."""
    inputs = {path: (ROOT / path).read_bytes() for path in KERNEL_SOURCES}
    inputs["levels"] = "\0".join(spec.kernel_levels).encode()
    if spec.kernel_build_packages:
        argv = layers.kernel_stage_command(spec, Path("TREE"), Path("APT"), Path("customize.sh"))
        inputs["stage"] = "\0".join(argv).encode()
    else:
        probe = [sys.executable, "-c", "import platform, torch; "
                 "print(platform.python_version(), torch.__version__)"]  # fmt: skip
        inputs["host"] = subprocess.run(probe, check=True, capture_output=True).stdout
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("flags")][:1]  # fmt: skip
        inputs["cpu"] = "".join(flags).encode()
    return inputs


def kernel_layer(
    spec: ImageSpec, cache: LayerCache, below: layers.Layer, stage: Path, wheel: str, work: Path
) -> layers.Layer:
    epoch = layer_epoch(KERNEL_FILES)
    key = layers.layer_key("kernels", kernel_inputs(spec), below.digest, epoch)
    layer = cache.get(key, with_tree=False)
    if layer is None:
        print(f"    building layer kernels ({key})", flush=True)
        with cache.new_entry(key) as entry:
            tree = entry / "tree"
            kernels = tree / specs.VENV.lstrip("/") / "share" / "kvpilot" / "kernels"
            kernels.mkdir(parents=True)
            if spec.kernel_build_packages:
                env = step_env(spec, stage, epoch, wheel)
                build_stage_kernels(spec, cache, kernels, env, work)
            else:
                for level in spec.kernel_levels:
                    build_kernel([sys.executable], level, kernels, cwd=ROOT)
            for path in [kernels, *kernels.parents]:  # the directories the venv layer has too
                if path == tree:
                    break
                path.chmod(0o755)
            layer = cache.put(entry, "kernels", tree, epoch)
            shutil.rmtree(tree)  # the layers above are not built on it
    return layer


def app_inputs(stage: Path, wheel: str) -> dict[str, bytes]:
    """What decides the app layer: the wheel's bytes (kvpilot's sources) and the step."""
    return {"wheel": (stage / wheel).read_bytes(), "customize.sh": HOOK.read_bytes(),
            "compile_pyc.py": COMPILE_PYC.read_bytes()}  # fmt: skip


def app_layer(
    spec: ImageSpec, cache: LayerCache, venv: tuple[layers.Layer, Path], base_tree: Path,
    stage: Path, wheel: str, epoch: int, work: Path,
) -> layers.Layer:  # fmt: skip
    """kvpilot's wheel installed into the venv: the layer a source change rebuilds."""
    key = layers.layer_key("app", app_inputs(stage, wheel), venv[0].digest, epoch)
    layer = cache.get(key, with_tree=False)
    if layer is None:
        print(f"    building layer app ({key})", flush=True)
        with cache.new_entry(key) as entry:
            tree = entry / "tree"
            with overlay([venv[1], base_tree], tree, work / "app-overlay") as root:
                env = step_env(spec, stage, epoch, wheel)
                subprocess.run(["bash", str(HOOK), "app", str(root)], env=env, check=True)
            layer = cache.put(entry, "app", tree, epoch)
            shutil.rmtree(tree)
    return layer
