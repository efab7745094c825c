"""Polling helpers for tests against a real API server: wait for a condition, never sleep."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T | None], timeout_s: float = 60, what: str = "") -> T:
    """Poll `predicate` until it returns something truthy; fail naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def get_json(cluster: Any, *args: str) -> Any:
    """`kubectl get ARGS -o json`, parsed."""
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
