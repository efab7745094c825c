"""Credentials at the gateway's edge, pure: the bearer token of an `Authorization` header, and the
one a replica gets.

- `Authorization: Bearer <token>`: the scheme in any case (RFC 7235: `bearer` and `BEARER` are
  `Bearer`), one or more spaces before the token.
- A replica (`kvpilot-runtime serve --api-key`) gets the gateway's own key when one is set
  (`--upstream-api-key-env`); else the client's header as it came, unless the gateway checked
  it against its own keys (a gateway key goes no further).
"""

from __future__ import annotations

import hashlib

SCHEME = "bearer"


def bearer_token(authorization: str | None) -> str | None:
    """The token of `Bearer <token>` (any case of the scheme), or None for anything else."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != SCHEME or not token:
        return None
    return token


def upstream_authorization(
    client: str | None, authenticated: bool, own_key: str | None
) -> str | None:
    """The `Authorization` a replica gets: the gateway's own key, else the client's own header
    when the gateway did not authenticate it (the replica checks it), else none."""
    if own_key:
        return f"Bearer {own_key}"
    if authenticated:
        return None
    return client


def forwards_client_credential(authenticated: bool, has_own_key: bool) -> bool:
    """Whether the replica judges the client's own credential (present or not)."""
    return not authenticated and not has_own_key


def credential_digest(authorization: str | None) -> str:
    """A hash naming the client's credential: the scheme (in lower case, RFC 7235) and the
    token of a bearer one, else the whole header as it came, so the same bearer token under any
    case of the scheme is one credential and a bare `KEY` is another; "" for none. The raw
    credential is never kept."""
    if not authorization:
        return ""
    token = bearer_token(authorization)
    credential = f"{SCHEME} {token}" if token is not None else authorization
    return hashlib.sha256(credential.encode()).hexdigest()
