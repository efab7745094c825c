"""operator/Dockerfile, read as text (no Docker engine in CI): pinned base, multi-stage, a final
stage without build tools, running as a numeric non-root user."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "operator" / "Dockerfile"


def stages() -> list[list[str]]:
    """Instructions per stage (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    found: list[list[str]] = []
    for line in lines:
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            found.append([])
        if found:
            found[-1].append(line)
    return found


def test_base_image_is_pinned_to_an_exact_release() -> None:
    (arg,) = [
        line for line in DOCKERFILE.read_text().splitlines() if line.startswith("ARG PYTHON_IMAGE=")
    ]
    image = arg.split("=", 1)[1]
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", image), image


def test_build_happens_in_its_own_stage() -> None:
    build, final = stages()[0], stages()[-1]
    assert len(stages()) >= 2
    assert any("python -m build" in line for line in build)
    assert any(line.startswith("COPY --from=build /opt/venv") for line in final)


def test_final_stage_has_no_build_tools_or_sources() -> None:
    final = " ".join(stages()[-1])
    for tool in ("pip install", "apt-get install", "gcc", "build-essential", "COPY operator"):
        assert tool not in final
    assert "pip uninstall" in final  # the base image's own installer goes too
    assert "--without-pip" in " ".join(stages()[0])


def test_runs_as_numeric_non_root_user_matching_the_chart() -> None:
    final = stages()[-1]
    users = [line.split()[1] for line in final if line.startswith("USER ")]
    assert users and users[-1] == "10001:10001"
    chart = (ROOT / "charts" / "kvpilot" / "templates" / "deployment.yaml").read_text()
    assert "runAsUser: 10001" in chart and "runAsGroup: 10001" in chart


def test_entrypoint_is_the_operator_cli() -> None:
    final = stages()[-1]
    assert 'ENTRYPOINT ["kvpilot-operator"]' in final


def test_the_image_carries_the_gateway_the_chart_runs_from_it() -> None:
    """The chart's gateway Deployment runs `kvpilot-gateway` from this image by default."""
    build = " ".join(stages()[0])
    assert "COPY gateway/kvpilot gateway/kvpilot" in build
    assert "[operator,gateway]" in build
    chart = (ROOT / "charts" / "kvpilot" / "templates" / "gateway-deployment.yaml").read_text()
    assert "command: [kvpilot-gateway]" in chart


@pytest.mark.parametrize("dockerfile", ["operator/Dockerfile", "runtime/Dockerfile"])
def test_the_build_stage_copies_every_package_the_wheel_holds(dockerfile: str) -> None:
    # hatchling refuses to build a wheel whose `packages` folder is missing: a package added to
    # pyproject.toml and not to a Dockerfile breaks that image's build, which no CI here runs.
    wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    copied = (ROOT / dockerfile).read_text()
    for folder in wheel["targets"]["wheel"]["packages"]:
        assert f"COPY {folder} {folder}" in copied, f"{dockerfile} does not copy {folder}"
