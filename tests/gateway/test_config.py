"""The static config file: the minimal form from the issue, every fallback kind, clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpilot.gateway.config import ConfigError, load_routes, routes_from
from kvpilot.gateway.routing.routes import Backend, Provider, Route


def test_minimal_form(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("models:\n  - name: tiny\n    backends: [http://10.0.0.5:8000/]\n")
    url = "http://10.0.0.5:8000"
    assert load_routes(path, env={}) == [Route("tiny", (Backend(url, url),))]


def test_fallbacks_to_a_model_and_a_provider() -> None:
    data = {
        "models": [
            {"name": "big", "backends": ["http://a:1"], "fallbackAfterSeconds": 5,
             "fallbacks": ["small", {"provider": {"baseURL": "https://api.example.com/v1",
                                                  "model": "gpt-4o-mini",
                                                  "apiKeyEnv": "EXAMPLE_KEY"}}]},
            {"name": "small", "backends": ["http://b:1"]},
        ]
    }  # fmt: skip
    big, small = routes_from(data, {"EXAMPLE_KEY": "sk-1"})
    provider = Provider("big/1", "https://api.example.com/v1", "gpt-4o-mini", "sk-1")
    assert big.fallbacks == ("small", provider)
    assert big.fallback_after_s == 5
    assert small == Route("small", (Backend("http://b:1", "http://b:1"),))


UNSET_KEY = {"provider": {"baseURL": "https://x/v1", "model": "g", "apiKeyEnv": "UNSET"}}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "models: Field required"),
        ({"models": []}, "models: List should have at least 1 item"),
        ({"models": [{"backends": []}]}, "models.0.name: Field required"),
        ({"models": [{"name": "m", "backends": ["10.0.0.5:8000"]}]}, "is not an http"),
        ({"models": [{"name": "m", "backend": []}]}, "models.0.backend: Extra inputs"),
        ({"models": [{"name": "m", "backends": ["http://a:1"]}] * 2}, "repeated: \\['m'\\]"),
        ({"models": [{"name": "m", "fallbacks": ["other"]}]}, "'other' is not another model"),
        ({"models": [{"name": "m", "fallbacks": ["m"]}]}, "'m' is not another model"),
        ({"models": [{"name": "m", "fallbacks": [UNSET_KEY]}]}, "apiKeyEnv 'UNSET' is not set"),
        ({"models": [{"name": "m", "fallbackAfterSeconds": 0}]}, "greater than 0"),
        ({"models": [{"name": "m"}]}, "'m' has no backends and no fallbacks, so no request"),
    ],
)
def test_bad_config_says_where(data: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        routes_from(data, env={})


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the gateway config"):
        load_routes(tmp_path / "missing.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ConfigError, match="cannot read the gateway config"):
        load_routes(bad, env={})
