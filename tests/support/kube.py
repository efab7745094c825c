"""Helpers for tests against a real API server: wait for a condition (never sleep), read objects,
and give a test a namespace of its own."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T | None], timeout_s: float = 60, what: str = "") -> T:
    """Poll `predicate` until it returns something truthy; fail naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    value: T | None = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last: {value!r}")


def get_json(cluster: Any, *args: str) -> Any:
    """`kubectl get ARGS -o json`, parsed."""
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


@contextlib.contextmanager
def fresh_namespace(cluster: Any, prefix: str) -> Iterator[str]:
    """A namespace of one test's own (`prefix-<random>`), deleted without waiting after it."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
