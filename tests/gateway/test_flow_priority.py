"""Priorities (flow/priority.py, the keys' and teams' in budget/config.py) and what reaches an
upstream (bodies.for_upstream), pure."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpilot.gateway.bodies import BadRequestError, for_upstream
from kvpilot.gateway.budget.config import KeysDocument, key_book
from kvpilot.gateway.config import routes_from
from kvpilot.gateway.flow import priority


@pytest.mark.parametrize(
    ("header", "body", "asked"),
    [
        (None, None, None),
        ("3", None, 3),
        (" -2 ", None, -2),
        (None, 4, 4),
        ("4", 4, 4),  # both, agreeing
    ],
)
def test_what_a_request_asks_for(header: str | None, body: Any, asked: int | None) -> None:
    assert priority.requested(header, body) == asked


@pytest.mark.parametrize(
    ("header", "body", "says"),
    [
        ("high", None, "must be an integer"),
        ("1.5", None, "must be an integer"),
        ("1_0", None, "must be an integer"),
        ("", None, "must be an integer"),
        ("999999999", None, "between"),
        (None, "3", "`priority` must be an integer"),
        (None, True, "`priority` must be an integer"),
        (None, 2.0, "`priority` must be an integer"),
        ("1", 2, "disagree"),
        ("10000000", None, "between"),
        ("-1000001", None, "between"),
        (None, -10_000_000, "between"),
    ],
)
def test_bad_priorities_are_400s_naming_the_fix(header: str | None, body: Any, says: str) -> None:
    with pytest.raises(BadRequestError, match=says) as caught:
        priority.requested(header, body)
    assert caught.value.param == "priority"


@pytest.mark.parametrize(
    ("allowed", "asked", "runs_at"),
    [(0, None, 0), (0, 5, 5), (2, 2, 2), (-3, 0, 0), (-3, None, -3)],
)
def test_a_request_may_lower_its_priority(allowed: int, asked: int | None, runs_at: int) -> None:
    assert priority.effective(allowed, asked, "key k") == runs_at


def test_a_request_may_not_raise_its_priority_above_its_keys() -> None:
    with pytest.raises(BadRequestError, match=r"better than key k's \(2\).*send 2 or more"):
        priority.effective(2, 1, "key k")


def test_keys_inherit_their_teams_priority_and_weight() -> None:
    document = KeysDocument.model_validate({
        "keys": [{"key": "sk-chat-0001", "team": "chat"},
                 {"key": "sk-chat-0002", "team": "chat", "priority": 3},
                 {"key": "sk-alone-001"}],
        "teams": [{"name": "chat", "priority": -1, "weight": 3}],
    })  # fmt: skip
    entries = sorted(key_book(document.keys, document.teams).values(), key=lambda e: e.priority)
    assert [(e.tenant, e.priority, e.weight) for e in entries] == [
        ("chat", -1, 3.0), (entries[1].tenant, 0, 1.0), ("chat", 3, 3.0)
    ]  # fmt: skip
    assert entries[1].tenant == f"key:{entries[1].key_id}"


@pytest.mark.parametrize(
    ("team", "says"),
    [({"name": "t", "weight": 0}, "greater than 0"), ({"name": "t", "priority": 10**7}, "less")],
)
def test_bad_team_settings_are_refused(team: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        KeysDocument.model_validate({"teams": [team]})


def test_scheduling_policy_priority_marks_a_route_that_takes_the_field() -> None:
    routes = routes_from({"models": [
        {"name": "a", "backends": ["http://a:8000"], "schedulingPolicy": "priority"},
        {"name": "b", "backends": ["http://b:8000"]},
    ]}, {})  # fmt: skip
    assert [r.takes_priority for r in routes] == [True, False]
    with pytest.raises(ValueError, match="schedulingPolicy"):
        routes_from({"models": [{"name": "a", "backends": ["http://a:8000"],
                                 "schedulingPolicy": "lifo"}]}, {})  # fmt: skip


RAW = b'{"model":"m","prompt":"hi"}'


@pytest.mark.parametrize(
    ("payload", "model", "runs_at", "sent"),
    [
        ({"model": "m", "prompt": "hi"}, "m", None, None),  # untouched: the raw bytes go
        ({"model": "m", "prompt": "hi"}, "m", 3, {"model": "m", "prompt": "hi", "priority": 3}),
        ({"model": "m", "prompt": "hi", "priority": 3}, "m", None, {"model": "m", "prompt": "hi"}),
        ({"model": "m", "prompt": "hi", "priority": None}, "m", None,
         {"model": "m", "prompt": "hi"}),
        ({"model": "m", "prompt": "hi", "priority": 1}, "m", 4,
         {"model": "m", "prompt": "hi", "priority": 4}),
        ({"model": "m", "prompt": "hi"}, "gpt-x", None, {"model": "gpt-x", "prompt": "hi"}),
    ],
)  # fmt: skip
def test_what_an_upstream_is_sent(
    payload: dict[str, Any], model: str, runs_at: int | None, sent: dict[str, Any] | None
) -> None:
    body = for_upstream(payload, RAW, model, runs_at)
    assert (body is RAW) if sent is None else json.loads(body) == sent
