"""No request can hurt the others (issue 40, item 12 on), on real server processes: deeply
nested JSON is a 400."""

from __future__ import annotations

import httpx
import pytest

from kvpilot.runtime.server.body_parsing import OFF_LOOP_MIN_BYTES
from tests.support.server_process import RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

JSON_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
# A bound on a wait, not a timing: each of these answers in milliseconds on a healthy server.
ANSWER_S = 60.0


# --- item 12: deeply nested JSON --------------------------------------------------------------

DEEP_BODIES = {
    "arrays, 256 KiB": b"[" * 262144,
    "objects, 256 KiB": (b'{"a":' * 50000).ljust(OFF_LOOP_MIN_BYTES, b" "),
    "arrays, small": b"[" * 5000,
    "a field 150 levels deep": b'{"model": "tiny", "zz": ' + b"[" * 150 + b"0" + b"]" * 150 + b"}",
}


@pytest.mark.parametrize("path", JSON_ENDPOINTS)
def test_deeply_nested_json_is_400_on_every_json_endpoint(server: RuntimeServer, path: str) -> None:
    for name, raw in DEEP_BODIES.items():
        headers = {"content-type": "application/json"}
        answer = httpx.post(f"{server.url}{path}", content=raw, headers=headers, timeout=ANSWER_S)
        assert answer.status_code == 400, (name, answer.text[:300])
        error = answer.json()["error"]
        assert "nested more than 100 levels deep" in error["message"], (name, error)
    assert httpx.get(f"{server.url}/health").status_code == 200
