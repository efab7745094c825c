"""Times as the Kubernetes API writes them (RFC 3339 in UTC), in one place. Pure."""

from __future__ import annotations

from datetime import UTC, datetime


def rfc3339(moment: datetime | None = None) -> str:
    """`2026-01-02T03:04:05Z` (a metav1.Time) of `moment`, default now."""
    return (moment or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339_from_unix(unix_s: float) -> str:
    return rfc3339(datetime.fromtimestamp(unix_s, UTC))


def micro_time(moment: datetime) -> str:
    """`2026-01-02T03:04:05.000006Z`, a metav1.MicroTime (Lease renewals)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse(stamp: str) -> datetime:
    """An API timestamp (`Z` or an offset) as an aware datetime."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def unix(stamp: str) -> float:
    """An API timestamp as unix seconds."""
    return parse(stamp).timestamp()
