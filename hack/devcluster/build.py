"""Builds the control-plane binaries from Go modules, once, into the version-keyed cache.

Kubernetes has no prebuilt download we can reach, so we compile k8s.io/kubernetes (via the
replace-directive module in hack/gotools/kubernetes), etcd (a wrapper module) and install kwok and
helm with `go install`. Progress is printed while each build runs; a failure is one line + log.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hack.devcluster.errors import DevClusterError
from hack.devcluster.versions import (
    ACTIONLINT,
    ETCD,
    GOTOOLS,
    HELM,
    KUBE_SCORE,
    KUBERNETES,
    KWOK,
    PROMETHEUS,
    PROMETHEUS_RELEASE,
    SEAWEEDFS,
    Component,
    ModuleFile,
    cache_dir,
)

PROGRESS_EVERY_S = 30.0


def kubernetes_ldflags(version: str) -> str:
    """Version stamps so `kubectl version` and the apiserver's /version report the pin."""
    major, minor = version.lstrip("v").split(".")[:2]
    pkg = "k8s.io/component-base/version"
    stamps = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    return "-s -w " + " ".join(f"-X {pkg}.{key}={value}" for key, value in stamps.items())


def build_commands(component: Component, out_dir: Path) -> list[tuple[list[str], Path | None]]:
    """(argv, working dir) pairs that build `component` into out_dir."""
    out = f"{out_dir}/"
    if component is KUBERNETES:
        pkgs = [f"k8s.io/kubernetes/cmd/{b}" for b in component.binaries]
        argv = ["go", "build", "-trimpath", "-ldflags", kubernetes_ldflags(component.version)]
        return [([*argv, "-o", out, *pkgs], GOTOOLS / "kubernetes")]
    if component is ETCD:
        return [
            (["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", out, "."], GOTOOLS / "etcd")
        ]
    if component is KWOK:
        return [
            (["go", "install", "-trimpath", f"sigs.k8s.io/kwok/cmd/kwok@{component.version}"], None)
        ]
    if component is PROMETHEUS:
        flags = f"-s -w -X github.com/prometheus/common/version.Version={PROMETHEUS_RELEASE}"
        pkg = f"github.com/prometheus/prometheus/cmd/prometheus@{component.version}"
        tags = "remove_all_sd,enable_kubernetes_sd"
        return [(["go", "install", "-trimpath", "-tags", tags, "-ldflags", flags, pkg], None)]
    if component is HELM:
        flags = f"-s -w -X helm.sh/helm/v3/internal/version.version={component.version}"
        pkg = f"helm.sh/helm/v3/cmd/helm@{component.version}"
        return [(["go", "install", "-trimpath", "-ldflags", flags, pkg], None)]
    if component is KUBE_SCORE:
        pkg = f"github.com/zegl/kube-score/cmd/kube-score@{component.version}"
        return [(["go", "install", "-trimpath", "-ldflags", "-s -w", pkg], None)]
    if component is ACTIONLINT:
        pkg = f"github.com/rhysd/actionlint/cmd/actionlint@{component.version}"
        return [(["go", "install", "-trimpath", "-ldflags", "-s -w", pkg], None)]
    if component is SEAWEEDFS:
        pkg = "github.com/seaweedfs/seaweedfs/weed"
        argv = ["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", f"{out}weed", pkg]
        return [(argv, GOTOOLS / "seaweedfs")]
    raise ValueError(f"no build recipe for {component.name}")


def require_go() -> str:
    go = shutil.which("go")
    if go is None:
        raise DevClusterError(
            "the Go toolchain is missing: install Go >= 1.26 (it builds the Kubernetes binaries)"
        )
    return go


@contextmanager
def build_lock(component: Component) -> Iterator[None]:
    """Held while `component` is built: two clones (or two tests) building the same component
    at once each wiped the other's staging directory, and one failed with "produced no ..."."""
    lock = component.bin_dir.with_name(component.bin_dir.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def ensure_built(component: Component) -> None:
    """Build `component` unless the cache already holds it (an atomic rename publishes it)."""
    if component.is_built():
        return
    require_go()
    with build_lock(component):
        if not component.is_built():  # the holder of the lock before us built it
            build(component)


def build(component: Component) -> None:
    logs = cache_dir() / "build-logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{component.name}-{component.version}.log"
    staging = component.bin_dir.with_name(component.bin_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    print(f"==> building {component.name} {component.version} (once; log: {log})", flush=True)
    started = time.monotonic()
    env = {**os.environ, "GOBIN": str(staging), "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"}
    with log.open("w") as log_file:
        for argv, cwd in build_commands(component, staging):
            run_with_progress(argv, cwd, env, log_file, component.name, started, log)
    missing = [b for b in component.binaries if not (staging / b).is_file()]
    if missing:
        raise DevClusterError(f"build of {component.name} produced no {', '.join(missing)}", log)
    shutil.rmtree(component.bin_dir, ignore_errors=True)
    staging.rename(component.bin_dir)
    print(f"    built {component.name} in {time.monotonic() - started:.0f}s", flush=True)


def run_with_progress(
    argv: list[str],
    cwd: Path | None,
    env: dict[str, str],
    log_file,
    name: str,
    started: float,
    log: Path,
) -> None:
    log_file.write(f"$ {' '.join(argv)}\n")
    log_file.flush()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    while True:
        try:
            code = proc.wait(timeout=PROGRESS_EVERY_S)
            break
        except subprocess.TimeoutExpired:
            print(f"    ... still building {name} ({time.monotonic() - started:.0f}s)", flush=True)
    if code != 0:
        raise DevClusterError(f"build of {name} failed (go exited {code})", log)


def ensure_module_file(wanted: ModuleFile) -> Path:
    """The file from the Go module at its pinned version: `go mod download` once (the module
    proxy), then a copy in the version-keyed cache that later calls return at once."""
    if wanted.cached.is_file():
        return wanted.cached
    require_go()
    argv = ["go", "mod", "download", "-json", f"{wanted.module}@{wanted.version}"]
    env = {**os.environ, "GOFLAGS": "-mod=mod"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    try:
        folder = Path(json.loads(done.stdout)["Dir"])
    except (ValueError, KeyError):
        problem = (done.stdout or done.stderr).strip().splitlines()[-3:]
        raise DevClusterError(
            f"go mod download {wanted.module}@{wanted.version} failed: {' '.join(problem)}"
        ) from None
    wanted.cached.parent.mkdir(parents=True, exist_ok=True)
    staging = wanted.cached.with_name(wanted.cached.name + ".partial")
    shutil.copyfile(folder / wanted.path, staging)
    staging.rename(wanted.cached)
    return wanted.cached


def ensure_all(components: tuple[Component, ...]) -> None:
    for component in components:
        ensure_built(component)


def main() -> int:
    from hack.devcluster.versions import COMPONENTS, INFERENCE_POOL_CRD

    try:
        ensure_all(COMPONENTS)
        ensure_module_file(INFERENCE_POOL_CRD)
    except DevClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
