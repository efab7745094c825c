"""Runs `kvpilot-operator` with its API writes counted, for bench.operator_scale.

The apiserver's own metrics cannot say which client wrote (the controller-manager and the bench
write the same resources), so the count is taken in the operator's process: every request that
is not a GET, through the Kubernetes client (the passes, the Lease) and through aiohttp (kopf's
own annotations and events), keyed by "METHOD resource[/subresource]". Each Deployment's first
PATCH (the pass's apply that creates it) is also timed, from the request's start to its answer,
on the machine's monotonic clock, which bench.operator_scale shares: where a create's latency
goes. Both are written as JSON to $KVPILOT_WRITES_FILE when the process exits (kopf stops cleanly
on SIGTERM): {"writes": {...}, "deployment_applies": {name: [start, end]}}.

Works on any version of the operator, so a baseline checkout is counted the same way:
    KVPILOT_WRITES_FILE=w.json python -m bench.operator_writes run
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

WRITES: Counter[str] = Counter()
APPLIES: dict[str, tuple[float, float]] = {}  # Deployment name -> its first PATCH's start, end
# /api/v1/namespaces/ns/pods/name/status -> pods/status; /apis/g/v/namespaces/ns/x/name -> x
_PATH = re.compile(
    r"^/(?:api/v1|apis/[^/]+/[^/]+)(?:/namespaces/[^/]+)?/(?P<resource>[^/?]+)"
    r"(?:/[^/?]+(?:/(?P<sub>[^/?]+))?)?"
)


def resource_of(url: str) -> str:
    """'deployments', 'modeldeployments/status', ... for an API URL (pure)."""
    path = urlsplit(url).path
    found = _PATH.match(path)
    if found is None:
        return path
    sub = found.group("sub")
    return found.group("resource") + (f"/{sub}" if sub else "")


def count(method: str, url: str) -> None:
    if method.upper() != "GET":
        WRITES[f"{method.upper()} {resource_of(url)}"] += 1


def deployment_of(method: str, url: str) -> str | None:
    """The Deployment a PATCH names, e.g. 'md-001-pool'; None for any other request (pure)."""
    if method.upper() != "PATCH" or resource_of(url) != "deployments":
        return None
    return urlsplit(url).path.rstrip("/").rsplit("/", 1)[-1]


def _wrap_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    def request(self: Any, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        count(method, url)
        deployment, start = deployment_of(method, url), time.monotonic()
        try:
            return original(self, method, url, *args, **kwargs)
        finally:
            if deployment is not None:
                APPLIES.setdefault(deployment, (start, time.monotonic()))

    return request


def _wrap_async(original: Callable[..., Any]) -> Callable[..., Any]:
    async def request(self: Any, method: str, url: Any, *args: Any, **kwargs: Any) -> Any:
        count(method, str(url))
        return await original(self, method, url, *args, **kwargs)

    return request


def recorded() -> dict[str, Any]:
    return {"writes": dict(WRITES), "deployment_applies": APPLIES}


def install() -> None:
    import aiohttp
    from kubernetes.client import rest

    rest.RESTClientObject.request = _wrap_sync(rest.RESTClientObject.request)  # type: ignore[method-assign]
    aiohttp.ClientSession._request = _wrap_async(aiohttp.ClientSession._request)  # type: ignore[method-assign]
    target = os.environ.get("KVPILOT_WRITES_FILE")
    if target:
        atexit.register(lambda: Path(target).write_text(json.dumps(recorded())))


def main() -> int:
    install()
    from kvpilot.operator.cli import main as operator_main

    return operator_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
