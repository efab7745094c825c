"""json_text.load_object: a JSON object, or an error that names where the text came from."""

from __future__ import annotations

import json

import pytest

from kvpilot.runtime.server.json_text import load_object


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"a": 1}', None),
        ("{}", None),
        ("{not json", "line 3: not JSON: Expecting property name"),
        ("", "line 3: not JSON: Expecting value"),
        ("[1, 2]", "line 3: expected an object with 'prompt'"),
        ('"text"', "line 3: expected an object with 'prompt'"),
        ("null", "line 3: expected an object with 'prompt'"),
    ],
)
def test_load_object_returns_the_object_or_says_where_and_what(
    text: str, error: str | None
) -> None:
    if error is None:
        assert load_object(text, "line 3", "an object with 'prompt'") == json.loads(text)
        return
    with pytest.raises(ValueError, match="^" + error.replace("(", r"\(")):
        load_object(text, "line 3", "an object with 'prompt'")
