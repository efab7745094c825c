"""An image's recipe: how it is made apart from kvpilot's own sources (the Dockerfiles, this
package, its locked pins), digested into the label `--if-changed` compares with a cached layout's,
and the spec's locked pins themselves (`uv export` of its extras), which the venv layer installs.
"""

from __future__ import annotations

import functools
import subprocess
import tomllib

from hack.images import layers
from hack.images import spec as specs
from hack.images.checkout import ROOT
from hack.images.spec import ImageSpec

# How an image is made, apart from kvpilot's own sources: a change to any of these is what CI
# rebuilds the image for (`--if-changed`), so the build itself is exercised at least once per
# change to a Dockerfile, the image's locked requirements or this recipe (every file of
# hack/images: tests/packaging/test_images.py checks that none is missing). The requirements are
# the image's own (its extras' pins, as `uv export` gives them): a dev dependency added to
# uv.lock is not a new image.
RECIPE = (
    "operator/Dockerfile", "runtime/Dockerfile", "runtime/Dockerfile.cpu", ".python-version",
    "hack/uv-requirements.txt", "hack/images/__init__.py", "hack/images/__main__.py",
    "hack/images/build.py", "hack/images/builders.py", "hack/images/checkout.py",
    "hack/images/compile_pyc.py", "hack/images/customize.sh", "hack/images/layer_cache.py",
    "hack/images/layers.py", "hack/images/oci_layout.py", "hack/images/recipe.py",
    "hack/images/spec.py", "hack/images/steps.py",
)  # fmt: skip
RECIPE_LABEL = "dev.kvpilot.image.recipe"


def tree_recipe_digest(spec: ImageSpec) -> str:
    return _tree_recipe_digest(spec.name)


@functools.cache  # by name: a spec holds a dict, so it is not hashable
def _tree_recipe_digest(name: str) -> str:
    files = {path: (ROOT / path).read_bytes() for path in RECIPE}
    files["requirements.txt"] = locked_requirements(specs.IMAGES[name]).encode()
    return layers.framed_digest(files)


def locked_requirements(spec: ImageSpec) -> str:
    """The spec's extras' pins from uv.lock, with hashes, as the image installs them."""
    argv = ["bash", str(ROOT / "hack" / "uv.sh"), *export_args(spec), "--no-header"]
    return subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True).stdout


def lock_package_names() -> list[str]:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    return [str(package["name"]) for package in lock.get("package", [])]


def export_args(spec: ImageSpec) -> list[str]:
    """`uv export` of the spec's extras' pins, less what it does not install."""
    extras = [arg for extra in spec.extras for arg in ("--extra", extra)]
    names = layers.not_installed_names(spec, lock_package_names()) if spec.not_installed else []
    omitted = [arg for name in names for arg in ("--no-emit-package", name)]
    return ["export", "--frozen", "--quiet", "--no-emit-project", *extras, *omitted]
