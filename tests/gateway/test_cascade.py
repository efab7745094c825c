"""Cascade rules: what the gateway counts of a prompt, which rule applies, and the rules as the
static config, the ModelDeployment API and kube_routes read them."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvpilot.gateway import bodies
from kvpilot.gateway.config import ConfigError, routes_from
from kvpilot.gateway.kube.routes import build_routes
from kvpilot.gateway.routing.cascade_rules import (
    CascadeRule,
    PromptFacts,
    choose,
    find_cycle,
    prompt_facts,
)
from kvpilot.operator import api

TOOL = {"type": "function", "function": {"name": "lookup"}}


@pytest.mark.parametrize(
    ("kind", "payload", "facts"),
    [
        (bodies.COMPLETIONS, {"prompt": "héllo"}, PromptFacts(6, False)),  # UTF-8 bytes
        (bodies.COMPLETIONS, {"prompt": [1, 2, 3]}, PromptFacts(3, False)),  # token ids
        (bodies.COMPLETIONS, {"prompt": ["ab", "cde"]}, PromptFacts(5, False)),  # a batch sums
        (bodies.COMPLETIONS, {"prompt": [[1, 2], [3]]}, PromptFacts(3, False)),
        (bodies.CHAT, {"messages": [{"role": "user", "content": "hi"}]}, PromptFacts(6, False)),
        (bodies.CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
         PromptFacts(10, False)),  # every string counts (role, part type): an upper bound
        (bodies.CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]},
         PromptFacts(6, True)),
        (bodies.CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": []},
         PromptFacts(6, False)),
    ],
)  # fmt: skip
def test_prompt_facts(kind: str, payload: dict[str, Any], facts: PromptFacts) -> None:
    assert prompt_facts(kind, payload) == facts


SHORT_NO_TOOLS = CascadeRule("small", max_prompt_tokens=100, no_tools=True)
MEDIUM = CascadeRule("medium", max_prompt_tokens=1000)


@pytest.mark.parametrize(
    ("rules", "facts", "chosen"),
    [
        ((SHORT_NO_TOOLS, MEDIUM), PromptFacts(100, False), 0),  # the limit is inclusive
        ((SHORT_NO_TOOLS, MEDIUM), PromptFacts(101, False), 1),
        ((SHORT_NO_TOOLS, MEDIUM), PromptFacts(10, True), 1),  # tools: not the first rule
        ((SHORT_NO_TOOLS, MEDIUM), PromptFacts(1001, False), None),
        ((MEDIUM, SHORT_NO_TOOLS), PromptFacts(10, False), 0),  # the first that applies
        ((CascadeRule("any"),), PromptFacts(10**6, True), 0),  # no conditions: always
        ((CascadeRule(None), MEDIUM), PromptFacts(1, False), 1),  # an unresolved target
        ((), PromptFacts(1, False), None),
    ],
)
def test_the_first_rule_whose_conditions_hold(
    rules: tuple[CascadeRule, ...], facts: PromptFacts, chosen: int | None
) -> None:
    assert choose(rules, facts) == chosen


def static(cascade: list[Any]) -> dict[str, Any]:
    return {"models": [{"name": "big", "backends": ["http://a:1"], "cascade": cascade},
                       {"name": "small", "backends": ["http://b:1"]}]}  # fmt: skip


def test_static_config_cascade() -> None:
    rules = [{"when": {"maxPromptTokens": 512, "noTools": True}, "model": "small"}]
    big, small = routes_from(static(rules), {})
    assert big.cascade == (CascadeRule("small", 512, True),)
    assert small.cascade == ()


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ([{"model": "huge"}], r"models\[big\]\.cascade\[0\]\.model: 'huge' is not another model"),
        ([{"model": "big"}], r"models\[big\]\.cascade\[0\]\.model: the rule sends 'big' to itself"),
        ([{"when": {"maxPromptTokens": 0}, "model": "small"}], "greater than or equal to 1"),
        ([{"when": {"maxTokens": 5}, "model": "small"}], "maxTokens: Extra inputs"),
    ],
)
def test_bad_cascade_rules_say_where(rules: list[Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        routes_from(static(rules), {})


def three(cascades: dict[str, list[str]]) -> dict[str, Any]:
    models = [{"name": name, "backends": [f"http://{name}:1"],
               "cascade": [{"model": t} for t in cascades.get(name, [])]}
              for name in ("big", "mid", "small")]  # fmt: skip
    return {"models": models}


@pytest.mark.parametrize(
    ("cascades", "message"),
    [
        ({"big": ["small"], "small": ["big"]},
         r"cycle \(models\[big\]\.cascade\[0\] -> small, models\[small\]\.cascade\[0\] -> big\)"),
        ({"big": ["mid"], "mid": ["small"], "small": ["mid"]},
         r"cycle \(models\[mid\]\.cascade\[0\] -> small, models\[small\]\.cascade\[0\] -> mid\)"),
        ({"big": ["small", "mid"], "mid": ["small", "big"]},
         r"cycle \(models\[big\]\.cascade\[1\] -> mid, models\[mid\]\.cascade\[1\] -> big\)"),
    ],
)  # fmt: skip
def test_cascade_rules_that_form_a_cycle_are_refused_naming_them(
    cascades: dict[str, list[str]], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        routes_from(three(cascades), {})


def test_a_chain_and_a_shared_target_are_no_cycle() -> None:
    routes = routes_from(three({"big": ["mid", "small"], "mid": ["small"]}), {})
    assert [len(r.cascade) for r in routes] == [2, 1, 0]
    assert find_cycle({"a": [(0, "c")], "b": [(0, "c")], "c": []}) is None


def md(name: str, cascade: list[Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"uri": f"hf://org/{name}", "servedName": name}}
    if cascade is not None:
        spec["routing"] = {"cascade": cascade}
    meta = {"name": name, "namespace": "ml", "creationTimestamp": "2026-01-01T00:00:00Z"}
    return {"metadata": meta, "spec": spec}


def test_kube_cascade_names_the_served_model_and_keeps_indices() -> None:
    rules = [{"when": {"noTools": True}, "modelDeployment": "gone"},
             {"when": {"maxPromptTokens": 64}, "modelDeployment": "small"}]  # fmt: skip
    resolution = build_routes([md("big", rules), md("small")], [], lambda *_: None)
    big = next(r for r in resolution.routes if r.model == "big")
    assert big.cascade == (CascadeRule(None, None, True), CascadeRule("small", 64, False))
    assert any("cascade[0]: no ModelDeployment 'gone'" in p for p in resolution.problems)


def test_kube_cascade_rules_forming_a_cycle_are_a_problem_naming_them() -> None:
    to_small = [{"modelDeployment": "small"}]
    to_big = [{"when": {"noTools": True}, "modelDeployment": "big"}]
    resolution = build_routes([md("big", to_small), md("small", to_big)], [], lambda *_: None)
    cycles = [p for p in resolution.problems if "form a cycle" in p]
    assert cycles == [
        "cascade rules form a cycle (big: cascade[0] -> small, small: cascade[0] -> big): a "
        "model that requests cascade to should not cascade back; remove one of them"
    ]


def test_the_api_model_and_its_checks() -> None:
    spec = api.ModelDeploymentSpec.model_validate(
        {"model": {"uri": "hf://org/big"},
         "routing": {"cascade": [{"when": {"maxPromptTokens": 512, "noTools": True},
                                  "modelDeployment": "small"}]}}
    )  # fmt: skip
    assert spec.routing.cascade[0].when.max_prompt_tokens == 512
    api.check_routing("big", spec)
    with pytest.raises(ValueError, match="cannot cascade to itself"):
        api.check_routing("small", spec)
    with pytest.raises(ValidationError):
        api.Routing.model_validate({"cascade": [{"model": "small"}]})
