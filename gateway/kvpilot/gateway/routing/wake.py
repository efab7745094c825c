"""Waking a model at zero replicas (architecture §3.7, "Wake from zero").

The proxy calls `Waker.wake(target)` when a request arrives for a route that has a scale target and
no ready replica; it then holds the request until discovery puts a backend in the RouteTable. The
Kubernetes waker (discovery's side) asks the operator for a replica; the static config has no scale
targets, so it never wakes anything.
"""

from __future__ import annotations

from typing import Protocol

from kvpilot.gateway.routing.routes import ScaleTarget


class Waker(Protocol):
    async def wake(self, target: ScaleTarget) -> None:
        """Ask for at least one replica of `target`; called again while requests stay held, so an
        implementation limits how often it writes."""
