"""What each daemonless image holds and how it runs: the same content runtime/Dockerfile and
operator/Dockerfile describe for people with Docker (tests/packaging/test_images.py compares them).

Pure data, read by hack/images/build.py (the adapter that runs mmdebstrap, uv and umoci) and by
the tests, so a change here is a change to both images' contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# The Debian release of both Dockerfiles' base (python:3.11.x-slim-bookworm): its python3 is the
# interpreter of .python-version, the one uv.lock's wheels are installed for.
DEBIAN_RELEASE = "bookworm"
DEBIAN_PYTHON = "3.11"  # bookworm's python3
# The CPU runtime's release: trixie ships a CPU-only torch (python3-torch, built for its python3),
# which PyPI's Linux torch is not (it links NVIDIA's CUDA wheels, GBs). uv.lock has cp313 wheels.
CPU_DEBIAN_RELEASE = "trixie"
CPU_DEBIAN_PYTHON = "3.13"  # trixie's python3
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_SECURITY_MIRROR = "http://deb.debian.org/debian-security"
VENV = "/opt/venv"
UID = 10001
USER_NAME = "kvpilot"
# Debian's default PATH (python:slim and the CUDA base put the same directories on it), with the
# venv first, as both Dockerfiles' `ENV PATH=/opt/venv/bin:$PATH` do.
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Documentation, manuals and translations: nothing in the images reads them. Copyright files stay
# (the licences of what ships).
DPKG_PATH_EXCLUDES = (
    "/usr/share/doc/*",
    "/usr/share/man/*",
    "/usr/share/info/*",
    "/usr/share/locale/*",
    "/usr/share/lintian/*",
)
DPKG_PATH_INCLUDES = ("/usr/share/doc/*/copyright",)


@dataclass(frozen=True)
class ImageSpec:
    """One OCI image: Debian packages, the locked virtualenv's extras, and the image config."""

    name: str
    dockerfile: str  # the Dockerfile that describes the same content
    dockerfile_packages: tuple[str, ...]  # what the Dockerfile installs with apt-get
    # What the Dockerfile's base image brings that Debian's essential set lacks and the image needs
    base_packages: tuple[str, ...]
    extras: tuple[str, ...]  # pyproject.toml extras installed from uv.lock into VENV
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: dict[str, str]
    exposed_ports: tuple[int, ...]
    volumes: tuple[str, ...] = ()
    home: str | None = None  # created and owned by the user; None: no home directory
    owned_dirs: tuple[str, ...] = field(default=())  # created and owned by the user
    # The paged-attention kernel built at image build for these portable x86-64 levels (the
    # runtime's paged_kernel.PORTABLE_LEVELS), installed under the venv: no pod compiles it
    kernel_levels: tuple[str, ...] = ()
    # The venv's bytecode compiled at build (as pip does in the Dockerfile): a start imports
    # torch from .pyc, not from source (PYTHONDONTWRITEBYTECODE keeps a pod from writing it)
    compile_bytecode: bool = False
    debian_release: str = DEBIAN_RELEASE
    debian_python: str = DEBIAN_PYTHON  # the release's python3: the venv's interpreter
    # Locked packages left out of the venv (fnmatch patterns over uv.lock's names): Debian's
    # packages bring them (torch), or nothing on this image loads them (CUDA's wheels)
    not_installed: tuple[str, ...] = ()
    # The venv sees Debian's dist-packages (python3-torch) after its own site-packages
    system_site_packages: bool = False
    # A build stage's extra Debian packages (a compiler, torch's headers): the kernels are built
    # in a root filesystem with them against the image's own torch, and only the kernels ship.
    # Empty: the kernels are built by the host venv's torch (uv.lock's, the image's too).
    kernel_build_packages: tuple[str, ...] = ()

    @property
    def debian_packages(self) -> tuple[str, ...]:
        return (*self.base_packages, *self.dockerfile_packages)

    @property
    def debian_suites(self) -> tuple[str, ...]:
        return (self.debian_release, f"{self.debian_release}-updates")

    @property
    def site_packages(self) -> str:
        return f"{VENV}/lib/python{self.debian_python}/site-packages"

    @property
    def user(self) -> str:
        return f"{UID}:{UID}"

    @property
    def passwd_line(self) -> str:
        home = self.home or "/nonexistent"
        return f"{USER_NAME}:x:{UID}:{UID}::{home}:/usr/sbin/nologin"

    @property
    def group_line(self) -> str:
        return f"{USER_NAME}:x:{UID}:"

    def env_list(self) -> list[str]:
        """The config's Env, sorted so the image config does not depend on dict order."""
        return [f"{key}={value}" for key, value in sorted(self.env.items())]


OPERATOR = ImageSpec(
    name="kvpilot-operator",
    dockerfile="operator/Dockerfile",
    dockerfile_packages=(),
    base_packages=("python3", "ca-certificates"),  # python:slim's Python and CA bundle
    extras=("operator", "gateway"),
    entrypoint=("kvpilot-operator",),
    cmd=("run",),
    env={
        "PATH": f"{VENV}/bin:{BASE_PATH}",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    },
    exposed_ports=(8080, 9090),
)

# runtime/Dockerfile's image, `kvpilot-runtime` (released as ghcr.io/kvpilot/runtime:<version>),
# the CUDA variant: the same packages, user, entrypoint, environment and port, on the
# same Debian release and Python. PyPI's Linux torch wheel depends on NVIDIA's CUDA wheels, so they
# come too (uv.lock pins that torch): the one image serves on CPU and on NVIDIA GPUs.
RUNTIME = ImageSpec(
    name="kvpilot-runtime",
    dockerfile="runtime/Dockerfile",
    dockerfile_packages=("tini",),
    # python:slim's Python and CA bundle; torch's libraries link libstdc++
    base_packages=("python3", "ca-certificates", "libstdc++6"),
    extras=("runtime",),
    entrypoint=("tini", "--", "kvpilot-runtime"),
    cmd=("serve", "--model", "/models/model", "--port", "8000"),
    env={
        "DEBIAN_FRONTEND": "noninteractive",
        "HF_HOME": "/models/.cache",
        "PATH": f"{VENV}/bin:{BASE_PATH}",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_CACHE_DIR": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    },
    exposed_ports=(8000,),
    volumes=("/models",),
    home="/home/kvpilot",
    owned_dirs=("/models",),
    kernel_levels=("x86-64-v4-bf16", "x86-64-v4", "x86-64-v3"),
    compile_bytecode=True,
)

# runtime/Dockerfile.cpu's image, `kvpilot-runtime-cpu` (released as
# ghcr.io/kvpilot/runtime:<version>-cpu), the CPU variant: Debian trixie's CPU-only torch
# (python3-torch 2.6) under the locked venv (system site-packages, without torch, triton and
# NVIDIA's wheels), the kernels built against that torch in a build stage with g++ and
# libtorch-dev, which the image itself lacks. Same user, entrypoint, command, env and port.
RUNTIME_CPU = replace(
    RUNTIME,
    name="kvpilot-runtime-cpu",
    dockerfile="runtime/Dockerfile.cpu",
    dockerfile_packages=("python3", "python3-torch", "ca-certificates", "tini"),
    base_packages=(),  # debian:trixie-slim brings nothing else the image needs
    debian_release=CPU_DEBIAN_RELEASE,
    debian_python=CPU_DEBIAN_PYTHON,
    not_installed=("torch", "triton", "nvidia-*"),
    system_site_packages=True,
    kernel_build_packages=("g++", "libtorch-dev"),
)

IMAGES = {spec.name: spec for spec in (OPERATOR, RUNTIME, RUNTIME_CPU)}
RUNTIMES = (RUNTIME, RUNTIME_CPU)
