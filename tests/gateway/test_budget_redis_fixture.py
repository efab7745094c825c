"""The shared redis-server fixture: a real server whose data survives a restart on the same port."""

from __future__ import annotations

from tests.support.redis_server import RedisServer, redis_server  # noqa: F401


def test_redis_keeps_its_data_across_a_restart(redis_server: RedisServer) -> None:  # noqa: F811
    redis_server.client().set("budget", "42")
    redis_server.stop()
    assert not redis_server.answers()
    redis_server.start()
    assert redis_server.client().get("budget") == b"42"
