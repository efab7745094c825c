"""Who may share a cached answer, pure: the scope that is part of every cache key, so a hit is
only ever an answer the caller could have had from the upstream itself, and one tenant never
learns (by the `x-kvpilot-cache` header or a hit's latency) what another asked.

- The replica judges the client's own credential (no gateway keys, no upstream key of the
  gateway's): the scope is that credential (a hash of it, never the key), so a hit needs the
  very credential the answer was stored for; a request without one has a scope of its own
  and never hits an entry stored with one.
- The gateway authenticated the caller (gateway keys): `cache.scope` decides. `team` (the
  default): the callers of one team share answers (a key without a team: its own); `key`: each
  key its own; `shared`: every caller (the upstream would answer any of them alike).
- Otherwise (no gateway keys, the gateway sends its own upstream key): one scope for all, as the
  upstream answers every caller alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.gateway.credentials import credential_digest

SCOPES = ("team", "key", "shared")
DEFAULT_SCOPE = "team"


@dataclass(frozen=True)
class Who:
    """The caller as the cache sees it."""

    key_id: str | None  # the gateway key it authenticated with; None: no gateway keys
    team: str = ""
    authorization: str | None = None  # the client's header
    judged_upstream: bool = False  # the replica checks that header itself


def scope_of(setting: str, who: Who) -> str:
    """The scope part of the cache key of `who`'s request under `cache.scope: setting`."""
    if who.judged_upstream:
        digest = credential_digest(who.authorization)
        return f"credential:{digest}" if digest else "anonymous"
    if who.key_id is None or setting == "shared":
        return "shared"
    if setting == "team" and who.team:
        return f"team:{who.team}"
    return f"key:{who.key_id}"
