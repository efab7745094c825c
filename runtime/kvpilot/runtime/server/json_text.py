"""JSON text that must hold an object, parsed with an error that says where it came from."""

from __future__ import annotations

import json
from typing import Any


def load_object(text: str, where: str, expected: str) -> dict[str, Any]:
    """`text` parsed as a JSON object; ValueError "where: ..." when it is not JSON or not an
    object (`expected` says what it should have been)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected {expected}")
    return value
