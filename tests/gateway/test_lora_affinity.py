"""Adapter-aware picking (routing/lora_affinity.py) and adapter routes from both discovery
sources: tables."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.contract import metric_names
from kvpilot.gateway.config import ConfigError, routes_from
from kvpilot.gateway.kube import routes as kube_routes
from kvpilot.gateway.routing import lora_affinity
from kvpilot.gateway.routing.lora_affinity import LoraState
from kvpilot.gateway.routing.picking import ReplicaLoad
from kvpilot.gateway.routing.routes import Backend

INFO = "vllm:lora_requests_info"
LOADED = metric_names.LORA_ADAPTER_LOADED


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vllm:num_requests_running 3\n", None),
        (
            f'{INFO}{{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters=""}} 1.7e9\n',
            LoraState(frozenset({"a", "b"}), frozenset(), 4),
        ),
        (  # the newest reading wins
            f"# TYPE {INFO} gauge\n"
            f'{INFO}{{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""}} 100\n'
            f'{INFO}{{max_lora="2",running_lora_adapters="",waiting_lora_adapters="c"}} 200\n',
            LoraState(frozenset(), frozenset({"c"}), 2),
        ),
        (  # LoRA off, as a vLLM without adapters reports
            f'{INFO}{{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""}} 1\n',
            LoraState(frozenset(), frozenset(), 0),
        ),
        (  # kvpilot says which adapters it holds
            f'{INFO}{{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""}} 1\n'
            f'{LOADED}{{lora_name="a",model_name="tiny"}} 1.0\n'
            f'{LOADED}{{lora_name="b",model_name="tiny"}} 1.0\n',
            LoraState(frozenset({"a"}), frozenset(), 2, loaded=frozenset({"a", "b"})),
        ),
        (  # ... and that it holds none (the family without a sample)
            f"# HELP {LOADED} LoRA adapters loaded.\n# TYPE {LOADED} gauge\n"
            f'{INFO}{{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}} 1\n',
            LoraState(frozenset(), frozenset(), 2, loaded=frozenset()),
        ),
    ],
)
def test_parse_lora_info(text: str, expected: LoraState | None) -> None:
    assert lora_affinity.parse_lora_info(text) == expected


A, B, C, D = (Backend(n, f"http://{n}") for n in "abcd")


def state(
    running: str = "", waiting: str = "", max_lora: int = 2, loaded: str | None = None
) -> LoraState:
    def names(text: str) -> frozenset[str]:
        return frozenset(n for n in text.split(",") if n)

    held = None if loaded is None else names(loaded)
    return LoraState(names(running), names(waiting), max_lora, held)


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ({}, [["a", "b", "c"]]),  # nothing reported: every replica may take it
        (  # running or waiting: holds it; a free slot next; full last
            {"a": state("x,y"), "b": state("sql"), "c": state(waiting="sql,x")},
            [["b", "c"], ["a"]],
        ),
        ({"a": state("x,y"), "b": state("x"), "c": state("x,y")}, [["b"], ["a", "c"]]),
        ({"a": state(max_lora=0)}, [["b", "c"], ["a"]]),  # LoRA off: never a free slot
        (  # a replica that says it lacks the adapter is left out
            {"a": state(loaded="x"), "b": state("x,y", loaded="sql,x,y"), "c": state()},
            [["c"], ["b"]],
        ),
        ({n: state(loaded="") for n in "abc"}, [["a", "b", "c"]]),  # unless all lack it
        (  # running it counts, whatever the loaded list says (read a moment apart)
            {"a": state("sql", loaded=""), "b": state(loaded="sql")},
            [["a"], ["b", "c"]],
        ),
    ],
)
def test_tiers(states: dict[str, LoraState], expected: list[list[str]]) -> None:
    got = lora_affinity.tiers("sql", [A, B, C], states)
    assert [[b.name for b in tier] for tier in got] == expected


def load(total: int, kv: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(in_flight=total, kv_usage=kv)


@pytest.mark.parametrize(
    ("loads", "states", "expected"),
    [
        ({}, {"b": state("sql")}, ["b"]),  # the holder
        ({}, {"a": state("x,y"), "c": state("x,y"), "d": state("x,y")}, ["b"]),  # free slot
        # the holder past the bound (4 replicas, 8 in flight: ceil(9/4 x 1.75) = 4): a free slot
        ({"b": load(4), "d": load(4)}, {"b": state("sql"), "c": state("x,y")}, ["a"]),
        # the holder's KV is hot: the next tier
        ({"b": load(0, kv=0.97)}, {"b": state("sql")}, ["a", "c", "d"]),
        # none within the bound and cool: every replica, the strategy's pick decides
        (
            {n: load(0, kv=0.97) for n in "abcd"},
            {"b": state("sql")},
            ["a", "b", "c", "d"],
        ),
        # the holders past the bound: spill to the other holders only, not to those lacking it
        (
            {"a": load(4), "b": load(4)},
            {
                "a": state(loaded="sql"),
                "b": state(loaded="sql"),
                "c": state(loaded=""),
                "d": state(loaded=""),
            },
            ["a", "b"],
        ),
        # ... even when the only holder is past it (one that lacks it would answer 404)
        (
            {"a": load(4), "b": load(1)},
            {
                "a": state(loaded="sql"),
                "b": state(loaded=""),
                "c": state(loaded=""),
                "d": state(loaded=""),
            },
            ["a"],
        ),
        # every replica says it lacks it (the operator is loading it): all, the 404s move on
        ({}, {n: state(loaded="") for n in "abcd"}, ["a", "b", "c", "d"]),
    ],
)
def test_preferred(
    loads: dict[str, ReplicaLoad], states: dict[str, LoraState], expected: list[str]
) -> None:
    got = lora_affinity.preferred("sql", [A, B, C, D], loads, states, 1.75, 0.95)
    assert [b.name for b in got] == expected


def test_config_adapters_are_routes_of_their_base_models_replicas() -> None:
    config = {
        "models": [
            {"name": "base", "backends": ["http://r1:8000", "http://r2:8000"],
             "fallbacks": ["small"], "adapters": ["sql", "support"]},
            {"name": "small", "backends": ["http://r3:8000"]},
        ]
    }  # fmt: skip
    routes = {r.model: r for r in routes_from(config, {})}
    assert sorted(routes) == ["base", "small", "sql", "support"]
    for name in ("sql", "support"):
        assert routes[name].adapter_of == "base"
        assert routes[name].backends == routes["base"].backends
        assert routes[name].fallbacks == ("small",)
    assert routes["base"].adapter_of is None


@pytest.mark.parametrize(
    "models",
    [
        [{"name": "base", "backends": ["http://r1:8000"], "adapters": ["sql", "sql"]}],
        [
            {"name": "base", "backends": ["http://r1:8000"], "adapters": ["small"]},
            {"name": "small", "backends": ["http://r3:8000"]},
        ],
    ],
)
def test_config_adapter_names_must_be_unique(models: list[dict[str, Any]]) -> None:
    with pytest.raises(ConfigError, match="model and adapter names must be unique"):
        routes_from({"models": models}, {})


def md(name: str, served: str, adapters: list[str], created: str = "1") -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": name, "creationTimestamp": created},
        "spec": {
            "model": {"uri": f"hf://org/{served}"},
            "adapters": [{"name": a, "uri": f"hf://org/{a}"} for a in adapters],
        },
    }


def test_kube_adapters_are_routes_and_a_taken_name_is_a_problem() -> None:
    deployments = [md("m1", "base", ["sql", "other"]), md("m2", "other", ["x"], created="2")]
    resolved = kube_routes.build_routes(deployments, [], lambda namespace, name, key: None)
    routes = {r.model: r for r in resolved.routes}
    assert sorted(routes) == ["base", "other", "sql", "x"]
    assert (routes["sql"].adapter_of, routes["x"].adapter_of) == ("base", "other")
    assert routes["sql"].scale_target == routes["base"].scale_target
    assert [p for p in resolved.problems if "adapter 'other' is not routed" in p]
