"""A request's priority (vLLM's `priority`: lower runs first, default 0), pure.

A key (or its team) carries the best priority its requests may have. A request may ask for a
worse one, never a better one: in the `x-kvpilot-priority` header, or in the body's `priority`
field (what the openai client sends with `extra_body`). Asking for a better one than the key's is
refused with a 400 rather than clamped: a caller that believes its request jumps the queue must
learn that it does not.
"""

from __future__ import annotations

import re
from typing import Any

from kvpilot.gateway.bodies import BadRequestError
from kvpilot.gateway.budget.config import MAX_PRIORITY, MIN_PRIORITY

HEADER = "x-kvpilot-priority"
_INTEGER = re.compile(r"-?[0-9]{1,20}")  # decimal only: int() would take "1_0" and "+3" too


def requested(header: str | None, body: Any) -> int | None:
    """The priority the request asks for (None: it asks for none); BadRequestError when the
    header or the field is not an integer in range, or the two disagree."""
    from_header = _parse_header(header) if header is not None else None
    from_body = _check_body(body) if body is not None else None
    if from_header is not None and from_body is not None and from_header != from_body:
        raise BadRequestError(f"the {HEADER} header ({from_header}) and the body's priority "
                              f"({from_body}) disagree; send one of them", "priority")  # fmt: skip
    return from_header if from_header is not None else from_body


def effective(allowed: int, asked: int | None, who: str) -> int:
    """The priority the request runs at: `asked` when given, else `allowed` (the key's);
    BadRequestError when `asked` is better (lower) than `allowed`."""
    if asked is None:
        return allowed
    if asked < allowed:
        raise BadRequestError(f"priority {asked} is better than {who}'s ({allowed}): a request may "
                              f"lower its priority (send {allowed} or more), never raise it; "
                              "lower values run first", "priority")  # fmt: skip
    return asked


def _parse_header(text: str) -> int:
    if not _INTEGER.fullmatch(text.strip()):
        raise BadRequestError(f"the {HEADER} header must be an integer (lower runs first), got "
                              f"{text[:40]!r}", "priority")  # fmt: skip
    return _in_range(int(text), f"the {HEADER} header")


def _check_body(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError("`priority` must be an integer (lower runs first)", "priority")
    return _in_range(value, "`priority`")


def _in_range(value: int, what: str) -> int:
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise BadRequestError(f"{what} must be between {MIN_PRIORITY} and {MAX_PRIORITY}, got "
                              f"{value}", "priority")  # fmt: skip
    return value
