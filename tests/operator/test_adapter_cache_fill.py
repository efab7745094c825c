"""Adapters through the model cache as data: which adapters go through it, which a pod may load
(their fill Job Complete), and what status.adapters and AdaptersLoaded say meanwhile."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator import api
from kvpilot.operator.adapters import cache_fill, placement, sync

CLAIM = "kvpilot-model-cache-abc"
WANT = {"sql": "hf://org/sql", "local": "file:///srv/local", "s3": "s3://bucket/s3"}
CACHED = ["hf://org/sql", "s3://bucket/s3"]


def job(uri: str, condition: str | None, message: str = "") -> tuple[str, dict[str, Any]]:
    found = [] if condition is None else [{"type": condition, "status": "True", "message": message}]
    return cache_fill.job_name(CLAIM, uri), {"status": {"conditions": found}}


@pytest.mark.parametrize(
    ("jobs", "ready", "waiting", "failed"),
    [
        ({}, ["local"], {"sql": "being fetched", "s3": "being fetched"}, set()),
        (
            dict([job("hf://org/sql", "Complete"), job("s3://bucket/s3", None)]),
            ["sql", "local"],
            {"s3": "being fetched"},
            set(),
        ),
        (
            dict(
                [job("hf://org/sql", "Complete"), job("s3://bucket/s3", "Failed", "BackoffLimit")]
            ),
            ["sql", "local"],
            {"s3": "failed (Job kvpilot-model-cache-abc-lora-"},
            {"s3"},
        ),
    ],
)
def test_a_cached_adapter_is_loadable_once_its_fill_job_is_complete(
    jobs: dict[str, Any], ready: list[str], waiting: dict[str, str], failed: set[str]
) -> None:
    gate = cache_fill.gate(WANT, CACHED, jobs, CLAIM)
    assert list(gate.ready) == ready and gate.failed == failed
    assert set(gate.waiting) == set(waiting)
    for name, part in waiting.items():
        assert part in gate.waiting[name]
    if failed:
        assert gate.waiting["s3"].endswith(": BackoffLimit")


@pytest.mark.parametrize(
    ("spec", "uris"),
    [
        ({"adapters": [{"name": "a", "uri": "hf://org/a"}]}, []),  # no cache
        ({"cache": {}, "adapters": [{"name": "a", "uri": "hf://org/a"}]}, ["hf://org/a"]),
        (
            {
                "cache": {},
                "adapters": [
                    {"name": "a", "uri": "hf://org/a"},
                    {"name": "b", "uri": "hf://org/a"},  # one fetch for one URI
                    {"name": "c", "uri": "file:///srv/c"},
                ],
            },
            ["hf://org/a"],
        ),
    ],
)
def test_only_fetched_adapters_of_a_cached_model_go_through_the_cache(
    spec: dict[str, Any], uris: list[str]
) -> None:
    model: dict[str, Any] = {"uri": "hf://org/model"}
    if "cache" in spec:
        model["cache"] = spec["cache"]
    parsed = api.parse_spec({"model": model, "adapters": spec["adapters"]})
    assert cache_fill.cached_uris(parsed) == uris


def test_job_names_fit_kubernetes_and_differ_per_uri_and_claim() -> None:
    names = {cache_fill.job_name(c, u) for c in (CLAIM, CLAIM + "x") for u in CACHED}
    assert len(names) == 4 and all(len(n) <= 63 for n in names)


def test_status_lists_waiting_adapters_in_spec_order_and_the_condition_says_fetching() -> None:
    gate = cache_fill.gate(WANT, CACHED, dict([job("hf://org/sql", "Complete")]), CLAIM)
    loaded = placement.statuses(gate.ready, [placement.PodAdapters("p", gate.ready)], [])
    status = sync.with_waiting(WANT, loaded, gate)
    assert [(s.name, s.pods) for s in status] == [("sql", ["p"]), ("local", ["p"]), ("s3", [])]
    assert "being fetched into the model cache" in status[2].message
    plan = {"p": ["sql", "local"]}
    fetching = set(gate.waiting) - gate.failed
    condition = placement.condition(status, plan, 1, 3, fetching)
    assert (condition.status, condition.reason) == ("False", "FetchingIntoCache")
    assert condition.message.startswith("adapter s3: being fetched into the model cache")
    done = placement.condition(status[:2], plan, 1, 3, ())
    assert (done.status, done.reason) == ("True", "AllLoaded")


def test_a_failed_fetch_is_a_load_failure_naming_it_and_the_others_served() -> None:
    jobs = dict([job("hf://org/sql", "Complete"), job("s3://bucket/s3", "Failed", "no bucket")])
    gate = cache_fill.gate(WANT, CACHED, jobs, CLAIM)
    loaded = placement.statuses(gate.ready, [placement.PodAdapters("p", gate.ready)], [])
    status = sync.with_waiting(WANT, loaded, gate)
    condition = placement.condition(
        status, {"p": ["sql", "local"]}, 1, 3, set(gate.waiting) - gate.failed
    )
    assert (condition.status, condition.reason) == ("False", "AdapterLoadFailed")
    assert "adapter s3: fetch into the model cache failed" in condition.message
    assert condition.message.endswith("no bucket (2 other adapter(s) served)")
