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


def client_micro_time(moment: datetime) -> datetime:
    """`moment` for a MicroTime field of the typed client's models (an Event's eventTime). The
    client writes datetimes with isoformat(), which leaves out a fraction of zero, and the API
    reads a MicroTime only with its six digits: a whole second moves on by one microsecond."""
    return moment if moment.microsecond else moment.replace(microsecond=1)


def parse(stamp: str) -> datetime:
    """An API timestamp (`Z` or an offset) as an aware datetime."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def unix(stamp: str) -> float:
    """An API timestamp as unix seconds."""
    return parse(stamp).timestamp()
