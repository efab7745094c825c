"""Cost per 1,000 requests and per million output tokens, from measured traffic (pure).

What a user compares node types by is cost on their own traffic, not price per hour: the
replicas each node type runs, times the price of one replica-hour (`status.plan[].pricePerHour`:
GPUs per replica x price per GPU), over the requests and output tokens those replicas completed
in the window (Prometheus rates of the runtime's `request_success` and `generation_tokens`
counters). Each figure is None with a reason when it cannot be known: no traffic, or no price.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class Traffic:
    """Completed requests and generated tokens per second, averaged over the window."""

    requests_per_s: float = 0.0
    output_tokens_per_s: float = 0.0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.requests_per_s + other.requests_per_s,
            self.output_tokens_per_s + other.output_tokens_per_s,
        )


def per_unit(price_per_hour: float, units_per_s: float, scale: float) -> float | None:
    """Price of `scale` units (1,000 requests, 1M tokens) at this rate; None with no traffic."""
    if units_per_s <= 0:
        return None
    return price_per_hour / SECONDS_PER_HOUR / units_per_s * scale


def figures(price_per_hour: float, traffic: Traffic) -> dict[str, Any]:
    return {
        "pricePerHour": round(price_per_hour, 6),
        "requestsPerSecond": round(traffic.requests_per_s, 6),
        "outputTokensPerSecond": round(traffic.output_tokens_per_s, 6),
        "perThousandRequests": _rounded(per_unit(price_per_hour, traffic.requests_per_s, 1e3)),
        "perMillionOutputTokens": _rounded(
            per_unit(price_per_hour, traffic.output_tokens_per_s, 1e6)
        ),
    }


def cost_status(
    replicas: Mapping[str, int],
    price_per_replica_hour: Mapping[str, float],
    traffic: Mapping[str, Traffic],
    window: str,
    currency: str = "USD",
) -> dict[str, Any]:
    """status.cost: the totals over every node type running replicas, and each type's own."""
    running = {nt: n for nt, n in replicas.items() if n > 0}
    unpriced = sorted(nt for nt in running if price_per_replica_hour.get(nt, 0.0) <= 0)
    per_type = {
        nt: {
            "replicas": n,
            **figures(n * price_per_replica_hour.get(nt, 0.0), traffic.get(nt, Traffic())),
        }
        for nt, n in sorted(running.items())
    }
    total_traffic = sum((traffic.get(nt, Traffic()) for nt in running), Traffic())
    total_price = sum(n * price_per_replica_hour.get(nt, 0.0) for nt, n in running.items())
    out: dict[str, Any] = {
        "currency": currency,
        "window": window,
        **figures(total_price, total_traffic),
        "nodeTypes": per_type,
    }
    reason = _reason(running, unpriced, total_traffic, window)
    if reason:
        out["reason"] = reason
    if unpriced:  # a cost that leaves out some replicas would look cheaper than it is
        out["perThousandRequests"] = out["perMillionOutputTokens"] = None
    return out


def merge_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """`new` as a JSON merge patch over `old`: keys `new` no longer has (a node type that stopped
    running, a reason that no longer holds) become null, so the apiserver removes them."""
    patch: dict[str, Any] = dict(new)
    old = old or {}
    for key in old.keys() - new.keys():
        patch[key] = None
    old_types = old.get("nodeTypes") or {}
    patch["nodeTypes"] = {
        **{node_type: None for node_type in old_types.keys() - new.get("nodeTypes", {}).keys()},
        **new.get("nodeTypes", {}),
    }
    return patch


def _reason(running: Mapping[str, int], unpriced: list[str], traffic: Traffic, window: str) -> str:
    if not running:
        return "no replicas running"
    if unpriced:
        return (
            f"no price for node type(s) {', '.join(unpriced)}: set pricePerHour in the "
            "operator's nodeTypes or the kvpilot.dev/price-per-hour node annotation"
        )
    if traffic.requests_per_s <= 0:
        return f"no requests completed in the last {window}"
    return ""


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
