"""Starting, health-checking and stopping the control-plane processes by their pid files.

`down` stops only what `up` started: a pid is signalled only while its command line still names
the binary we launched, so a recycled pid is never touched.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection
from contextlib import ExitStack
from pathlib import Path

from hack.devcluster.errors import DevClusterError
from hack.devcluster.versions import REPO_ROOT


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int, taken: Collection[int] = ()) -> list[int]:
    """`count` distinct ports free on loopback now, none of them in `taken`. Every socket stays
    bound until all are picked: one picked and closed at a time, the kernel handed out a port
    twice (SeaweedFS's S3 gateway and its filer got the same one and the store did not start)."""
    ports: list[int] = []
    with ExitStack() as held:
        while len(ports) < count:
            sock = held.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in taken:
                ports.append(port)
    return ports


def require_port_free(port: int, who: str) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            raise DevClusterError(
                f"port {port} for {who} is in use on 127.0.0.1 ({err.strerror});"
                " choose another port or stop what holds it"
            ) from err


def start(
    name: str, argv: list[str], run_dir: Path, log_dir: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start `argv` in its own session, logging to log_dir/name.log; record the pid."""
    log_dir.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=REPO_ROOT,  # so `python -m hack.…` processes import this checkout
            env=env,
        )
    (run_dir / f"{name}.pid").write_text(f"{proc.pid}\n{argv[0]}\n")
    # Just after exec the kernel may still show an empty command line, in which `pid_runs`
    # would not recognise the process yet: wait the few milliseconds until it shows.
    wait_for(lambda: proc.poll() is not None or _has_cmdline(proc.pid), 2.0, interval_s=0.005)
    return proc


def _has_cmdline(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().strip(b"\0") != b""
    except OSError:
        return False


def recorded(run_dir: Path, name: str) -> tuple[int, str] | None:
    try:
        pid_text, binary = (run_dir / f"{name}.pid").read_text().splitlines()[:2]
    except (OSError, ValueError):
        return None
    return int(pid_text), binary


def is_running(run_dir: Path, name: str) -> bool:
    entry = recorded(run_dir, name)
    return entry is not None and pid_runs(*entry)


def pid_runs(pid: int, binary: str) -> bool:
    """True while `pid` is alive and is still the process we started from `binary`."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    # A script started by path runs as `interpreter script ...`, so look at the first two.
    return binary in argv[:2] and state != "Z"


def stop(run_dir: Path, name: str, grace_s: float = 10.0) -> None:
    entry = recorded(run_dir, name)
    if entry is not None and pid_runs(*entry):
        pid, binary = entry
        os.killpg(pid, signal.SIGTERM)
        if not wait_for(lambda: not pid_runs(pid, binary), grace_s):
            os.killpg(pid, signal.SIGKILL)
            wait_for(lambda: not pid_runs(pid, binary), 5.0)
    (run_dir / f"{name}.pid").unlink(missing_ok=True)


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_healthy(
    proc: subprocess.Popen[bytes],
    url: str,
    log: Path,
    timeout_s: float,
    context: ssl.SSLContext | None = None,
) -> None:
    """Wait until `url` answers 200; fail fast with the log path if the process died."""
    name = Path(str(proc.args[0])).name  # type: ignore[index]
    wait_for(lambda: proc.poll() is not None or http_ok(url, context), timeout_s)
    if proc.poll() is not None:
        raise DevClusterError(f"{name} exited with code {proc.returncode} at start", log)
    if not http_ok(url, context):
        raise DevClusterError(f"{name} not healthy after {timeout_s:.0f}s ({url})", log)
