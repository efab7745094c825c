"""`TokenIds`: a request's list of token ids, validated in slices that let other threads run.

pydantic validates a list in one Rust call that holds the GIL: 2.8 M ids (a 16 MiB body) stop
every other thread, the event loop's included, for 0.2-0.5 s even when the body is parsed off
the loop (server/body_parsing.py). A list that holds only ints is accepted here a slice at a time,
with the interpreter free to switch threads between slices; anything else goes to pydantic's own
list[int] validation, so its coercions and error messages are unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ValidatorFunctionWrapHandler, WrapValidator

SLICE = 1 << 16  # ~1 ms of checking: the longest the GIL is held per slice


def slices(ids: list[Any]) -> list[list[Any]]:
    return [ids[start : start + SLICE] for start in range(0, len(ids), SLICE)]


def holds_only_ints(value: object) -> bool:
    """A non-empty list of exact ints (bool, a subclass of int, is not a token id)."""
    if not isinstance(value, list) or not value:
        return False
    return all(set(map(type, part)) == {int} for part in slices(value))


def has_negative(ids: list[int]) -> bool:
    return any(min(part) < 0 for part in slices(ids))


def _validate_in_slices(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    return value if holds_only_ints(value) else handler(value)


TokenIds = Annotated[list[int], WrapValidator(_validate_in_slices)]
