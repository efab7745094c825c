"""The keys/teams/redis/prices config: the issue's minimal form, LiteLLM's shapes, clear errors."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.gateway.budget.arithmetic import Price
from kvpilot.gateway.budget.config import KeysDocument, hash_key, key_book
from kvpilot.gateway.budget.keys import KeyRing
from kvpilot.gateway.config import ConfigError, GatewayConfig, routes_from
from kvpilot.gateway.kube import routes as kube_routes
from kvpilot.gateway.kube.keys_secret import apply_keys, parse_keys_document

MODELS = [{"name": "tiny", "backends": ["http://10.0.0.5:8000"]}]


def book_of(keys: list[dict[str, Any]], teams: list[dict[str, Any]] | None = None) -> Any:
    document = KeysDocument.model_validate({"keys": keys, "teams": teams or []})
    return key_book(document.keys, document.teams)


def test_the_issues_minimal_form_is_valid_and_keys_are_kept_hashed() -> None:
    data = {"models": MODELS, "keys": [{"key": "sk-local-1", "team": "research",
            "limits": [{"unit": "total_tokens", "limit": 2000, "window": "1h"}]}]}  # fmt: skip
    config = GatewayConfig.model_validate(data)
    assert routes_from(data, {})[0].model == "tiny"
    book = key_book(config.keys, config.teams)
    entry = book[hash_key("sk-local-1")]
    assert "sk-local-1" not in repr(book)
    assert entry.team == "research" and entry.key_id == hash_key("sk-local-1")[:12]
    assert [(lim.scope, lim.unit, lim.limit, lim.window.seconds) for lim in entry.limits] == [
        (f"key:{entry.key_id}", "total_tokens", 2000, 3600)
    ]


def test_litellm_shapes_and_team_limits_join_the_keys_own() -> None:
    keys = [
        {
            "keySha256": hash_key("sk-a"),
            "team": "ops",
            "rpm_limit": 60,
            "tpm_limit": 1000,
            "max_budget": 5,
            "budget_duration": "30d",
            "models": ["tiny"],
        }
    ]
    teams = [{"name": "ops", "limits": [{"unit": "cost", "limit": 100, "window": "month"}]}]
    entry = book_of(keys, teams)[hash_key("sk-a")]
    assert [(lim.scope.split(":")[0], lim.unit, lim.limit, lim.window.text)
            for lim in entry.limits] == [
        ("key", "requests", 60, "1m"), ("key", "total_tokens", 1000, "1m"),
        ("key", "cost", 5, "30d"), ("team", "cost", 100, "month"),
    ]  # fmt: skip
    assert entry.models == frozenset({"tiny"})


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ([{"team": "x"}], "give one of key"),
        ([{"key": "sk-local-1", "keySha256": hash_key("sk-local-1")}], "give one of key"),
        ([{"keySha256": "ABC"}], "64 lowercase hex"),
        ([{"key": "sk-local-1", "max_budget": 5}], "needs budget_duration"),
        ([{"key": "sk-local-1", "limits": [{"unit": "tokens", "limit": 5, "window": "1h"}]}],
         "requests"),
        ([{"key": "sk-local-1", "limits": [{"unit": "requests", "limit": 5, "window": "1y"}]}],
         "like 1m, 1h"),
        ([{"key": "sk-local-1", "limits": [{"unit": "requests", "limit": 0, "window": "1h"}]}],
         "greater than 0"),
    ],
)  # fmt: skip
def test_mistakes_name_their_place_and_the_fix(keys: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        routes_from({"models": MODELS, "keys": keys}, {})
    assert "keys.0" in str(error.value)


def test_a_key_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        book_of([{"key": "sk-local-1"}, {"keySha256": hash_key("sk-local-1")}])


def test_a_keys_secret_document_parses_like_the_config() -> None:
    text = (f"keys:\n  - keySha256: {hash_key('sk-b')}\n    team: t\n"
            "teams:\n  - name: t\n    rpm_limit: 5\n")  # fmt: skip
    document = parse_keys_document(text, "Secret ns/keys keys.yaml")
    assert book_of([k.model_dump(by_alias=True) for k in document.keys])
    with pytest.raises(ConfigError, match=r"Secret ns/keys keys\.yaml: keys\.0"):
        parse_keys_document("keys: [{team: t}]", "Secret ns/keys keys.yaml")


@pytest.mark.parametrize(
    ("status", "price"),
    [
        ({"cost": {"perMillionOutputTokens": 0.42}}, Price(0.0, 0.42)),
        ({"cost": {"perMillionOutputTokens": None, "reason": "no traffic"}}, None),
        ({}, None),
    ],
)
def test_a_model_deployments_measured_cost_is_its_routes_price(
    status: dict[str, Any], price: Price | None
) -> None:
    assert kube_routes.price({"spec": {}, "status": status}) == price


def test_a_bad_keys_secret_keeps_the_keys_last_read() -> None:
    ring = KeyRing({})
    good = f"keys: [{{keySha256: {hash_key('sk-c')}, team: t}}]"
    assert apply_keys(good, ring, "Secret ns/keys")
    assert ring.lookup("Bearer sk-c") is not None
    assert not apply_keys("keys: [{team: t}]", ring, "Secret ns/keys")  # no key: refused
    assert not apply_keys(": not yaml :", ring, "Secret ns/keys")
    assert ring.lookup("Bearer sk-c") is not None
    assert ring.lookup("Bearer sk-other") is None
