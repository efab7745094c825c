"""A real `redis-server` for tests (Debian's, which hack/system-deps.sh installs):
started on a free port in a temp dir, with the append-only file synced on every write so a
restart keeps its data (as a production Redis holding budgets should be run), and restartable on
the same port to test a Redis outage.

    from tests.support.redis_server import redis_server  # noqa: F401  (the fixture)

    def test_x(redis_server: RedisServer) -> None:
        ... redis_server.url ...   # redis://127.0.0.1:PORT/0
        redis_server.stop(); redis_server.start()
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis

from tests.support.processes import terminate
from tests.support.server_process import free_port, wait_for

REDIS_SERVER = "redis-server"


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None, args: Sequence[str] = ()) -> None:
        binary = shutil.which(REDIS_SERVER)
        if binary is None:
            raise RuntimeError("redis-server is not installed: run hack/system-deps.sh (apt)")
        self.binary, self.workdir = binary, workdir
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = workdir / "redis.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.args = list(args)  # more redis-server flags (e.g. --cluster-enabled yes)

    def start(self) -> None:
        """Start (again, on the same port and data dir) and wait until it answers PING."""
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                   "--dir", str(self.workdir), "--appendonly", "yes", "--appendfsync", "always",
                   "--save", "", "--daemonize", "no", "--logfile", str(self.log_path),
                   *self.args]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for(self._started, 30, f"redis-server on port {self.port} (log: {self.log_path})")

    def _started(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            stderr = self.process.stderr.read().decode() if self.process.stderr else ""
            raise RuntimeError(f"redis-server exited: {stderr}{self.log_tail()}")
        return self.answers()

    def answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2)

    def stop(self) -> None:
        """SIGTERM (Redis syncs its append-only file and exits) and wait."""
        if self.process is None or self.process.poll() is not None:
            return
        terminate(self.process, 30)
        if self.process.stderr is not None:
            self.process.stderr.close()

    def log_tail(self) -> str:
        return self.log_path.read_text()[-2000:] if self.log_path.exists() else ""


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()
