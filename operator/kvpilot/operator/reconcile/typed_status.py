"""A ModelDeployment's status as the typed `api.ModelDeploymentStatus`, parsed once where the
object comes in, and the wire form written back (pure).

Parsing is lenient: status is written by this operator (and by older versions of it), so a part
that no longer validates (a condition another writer malformed, a field an old version wrote
differently) is dropped and the rest is kept; a pass must never fail over its own bookkeeping.
The next write replaces what was dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from kvpilot.operator import api

log = logging.getLogger(__name__)
EMPTY = api.ModelDeploymentStatus()
# Each round drops at least one element; a status has far fewer than this.
MAX_ROUNDS = 1000


def of(md: Mapping[str, Any]) -> api.ModelDeploymentStatus:
    """The status of a ModelDeployment object; EMPTY before its first pass."""
    return parse(md.get("status"))


def parse(raw: object) -> api.ModelDeploymentStatus:
    """`raw` as the typed status, without the parts that do not validate (logged); EMPTY when
    nothing does (status is not even an object)."""
    data = _plain(raw or {})
    dropped: list[str] = []
    for _round in range(MAX_ROUNDS):
        try:
            status = api.ModelDeploymentStatus.model_validate(data)
        except ValidationError as error:
            where = _drop_first_invalid(data, error)
            if where is None:
                break
            dropped.append(where)
            continue
        if dropped:
            log.warning("status: ignoring what does not validate: %s", ", ".join(dropped))
        return status
    log.warning("status: does not validate; starting from an empty status")
    return EMPTY


def wire(model: BaseModel, **options: Any) -> dict[str, Any]:
    """The JSON written to the API: camelCase keys, no nulls (in a merge patch a null deletes,
    so a None must never reach one by accident)."""
    return model.model_dump(by_alias=True, exclude_none=True, mode="json", **options)


def _drop_first_invalid(data: dict[str, Any], error: ValidationError) -> str | None:
    """Remove the innermost element holding the first error from `data`; its path, or None
    when there is nothing to remove (the error is about the status as a whole)."""
    first = error.errors()[0]
    path = list(first["loc"])
    if first["type"] == "missing":
        path = path[:-1]  # a required field is absent: its object goes
    while path:
        parent = _find(data, path[:-1])
        key = path[-1]
        if isinstance(parent, dict) and key in parent:
            del parent[key]
            return ".".join(str(part) for part in path)
        if isinstance(parent, list) and isinstance(key, int) and 0 <= key < len(parent):
            del parent[key]
            return ".".join(str(part) for part in path)
        path = path[:-1]  # a location pydantic names but the data lacks (e.g. a dict's [key])
    return None


def _find(data: Any, path: list[Any]) -> Any:
    for part in path:
        if isinstance(data, dict):
            data = data.get(part)
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        else:
            return None
    return data


def _plain(value: Any) -> Any:
    """A mutable copy of a JSON-like value (kopf hands over read-only mappings)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
