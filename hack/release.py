"""What a release publishes, from one place: the version in pyproject.toml.

    python -m hack.release outputs --tag v0.1.0    # key=value lines for $GITHUB_OUTPUT
    python -m hack.release images                  # "<OCI layout> <registry reference>" per image

The release workflow (.github/workflows/release.yml) runs both on a tag: the tag must be
`v<version>`, and the chart's version and appVersion, the image tags and the operator's default
runtime image all carry that version (tests/packaging/test_release.py checks the committed files
agree, so a release cannot publish a chart that names images it did not push). The Python version
comes from `.python-version`, read by uv, the workflow's setup-python and the Dockerfiles' test.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

import yaml

from hack.devcluster import versions
from hack.images import checkout
from hack.images.spec import IMAGES

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvpilot" / "Chart.yaml"
PYTHON_VERSION_FILE = ROOT / ".python-version"
REGISTRY = "ghcr.io/kvpilot"
# Where each daemonless image is pushed: the names the chart and the operator pull.
REPOSITORIES = {
    "kvpilot-operator": f"{REGISTRY}/operator",
    "kvpilot-runtime": f"{REGISTRY}/runtime",
}
# Variants pushed to another image's repository under a tag suffix, as vLLM (vllm-openai:<v>,
# the CPU build as its own tag) and KServe users expect: ghcr.io/kvpilot/runtime:0.1.0-cpu.
VARIANT_TAGS = {"kvpilot-runtime-cpu": ("kvpilot-runtime", "cpu")}
CHART_REPOSITORY = f"oci://{REGISTRY}/charts"


class ReleaseError(Exception):
    """The tree cannot be released as it is; the message says what to change."""


def version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def python_version() -> str:
    return PYTHON_VERSION_FILE.read_text().strip()


def check_tag(tag: str, package_version: str) -> None:
    if tag != f"v{package_version}":
        raise ReleaseError(
            f"the tag {tag!r} is not v{package_version}, the version in pyproject.toml: tag"
            f" v{package_version}, or change [project].version and the chart's versions first"
        )


def check_chart(chart: dict[str, object], package_version: str) -> None:
    """The committed chart names the version it will be published as (helm package reads it)."""
    for key in ("version", "appVersion"):
        if str(chart.get(key)) != package_version:
            raise ReleaseError(
                f"charts/kvpilot/Chart.yaml {key} is {chart.get(key)!r}, pyproject.toml's version"
                f" is {package_version!r}: set them equal"
            )


def outputs(tag: str) -> dict[str, str]:
    package_version = version()
    check_tag(tag, package_version)
    check_chart(yaml.safe_load(CHART.read_text()), package_version)
    return {
        "version": package_version,
        "python": python_version(),
        "helm": versions.HELM_VERSION,
        "chart_repository": CHART_REPOSITORY,
    }


def image_references(package_version: str) -> list[tuple[Path, str]]:
    """Each image's OCI layout (as `make images` leaves it) and the reference it is pushed to."""
    pushed = {**{name: (repository, package_version) for name, repository in REPOSITORIES.items()},
              **{name: (REPOSITORIES[base], f"{package_version}-{suffix}")
                 for name, (base, suffix) in VARIANT_TAGS.items()}}  # fmt: skip
    if set(pushed) != set(IMAGES):
        raise ReleaseError(
            f"hack/release.py pushes {sorted(pushed)}, the images are {sorted(IMAGES)}"
        )
    return [
        (checkout.layout_dir(IMAGES[name]), f"{repository}:{tag}")
        for name, (repository, tag) in sorted(pushed.items())
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hack.release", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    outputs_parser = commands.add_parser("outputs", help="check the tag; print key=value lines")
    outputs_parser.add_argument("--tag", required=True, help="the pushed git tag, e.g. v0.1.0")
    commands.add_parser("images", help="print '<layout> <reference>' per image")
    args = parser.parse_args(argv)
    try:
        if args.command == "outputs":
            print("\n".join(f"{key}={value}" for key, value in outputs(args.tag).items()))
        else:
            for layout, reference in image_references(version()):
                print(f"{layout} {reference}")
    except ReleaseError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
