"""The metric names the operator and the gateway read (kvpilot.contract.metric_names) are the
names the runtime's /metrics exposes: the contract read from the runtime's side."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.contract import metric_names
from kvpilot.runtime.engine.stats import EngineStats
from kvpilot.runtime.server.metrics import ServerMetrics
from kvpilot.runtime.server.rendering import Tracker

READ_BY_OTHERS = [
    metric_names.REQUESTS_WAITING,
    metric_names.REQUESTS_RUNNING,
    metric_names.KV_CACHE_USAGE,
    metric_names.TIME_TO_FIRST_TOKEN,
    metric_names.REQUEST_SUCCESS,
    metric_names.GENERATION_TOKENS,
    metric_names.REQUEST_RECEIVED,
]


def exposed_sample_names() -> set[str]:
    idle = EngineStats(0, 0, 8, 8, 0.0, 0, 0, 0)  # nothing queued or running, 8 free blocks
    metrics = ServerMetrics("tiny", lambda: idle)
    metrics.success[0].labels("tiny", "stop").inc()  # a labelled counter shows once it counts
    metrics.success[1].labels("tiny", "stop").inc()
    text = generate_latest(metrics.registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.mark.parametrize("metric", READ_BY_OTHERS, ids=lambda m: m.kvpilot)
def test_the_runtime_exposes_every_name_others_read(metric: metric_names.RuntimeMetric) -> None:
    exposed = exposed_sample_names()
    for name in (metric.kvpilot, metric.vllm):
        # a histogram is read through its _bucket/_count samples
        assert {name, f"{name}_count"} & exposed, f"/metrics lacks {name}"


def test_the_pre_09_kv_usage_name_is_exposed_too() -> None:
    assert metric_names.KV_CACHE_USAGE_BEFORE_VLLM_09 in exposed_sample_names()


def test_a_request_counts_as_received_when_it_starts_and_as_done_when_it_ends() -> None:
    # The autoscaler's arrival rate must see a request while it runs, not once it finished.
    idle = EngineStats(0, 0, 8, 8, 0.0, 0, 0, 0)
    metrics = ServerMetrics("tiny", lambda: idle)

    def count(name: str) -> float:
        text = generate_latest(metrics.registry).decode()
        found = [
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == name
        ]
        return sum(found)

    received, done = metric_names.REQUEST_RECEIVED, metric_names.REQUEST_SUCCESS
    assert count(received.kvpilot) == count(received.vllm) == 0  # exported before any request
    tracker = Tracker(metrics, arrival=0.0, num_prompt=3)
    assert count(received.kvpilot) == count(received.vllm) == 1
    assert count(done.kvpilot) == 0
    tracker.close()
    assert count(received.kvpilot) == count(done.kvpilot) == 1


def test_the_lora_names_the_operator_and_the_gateway_read_are_exposed() -> None:
    """Requests per adapter (the operator's placement reads them, adapters/pod_api) and the
    adapters held (the gateway's picking, routing/lora_affinity), under the contract's names."""
    stats = EngineStats(0, 0, 8, 8, 0.0, 0, 0, 0, max_lora=2, loaded_lora_adapters=("a", "b"))
    metrics = ServerMetrics("tiny", lambda: stats)
    metrics.start_lora_series("b")  # loaded, no request yet: 0, so rate() sees its first
    metrics.record_lora_received("a", 2)
    text = generate_latest(metrics.registry).decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    received = {
        s.labels[metric_names.LORA_NAME_LABEL]: s.value
        for s in samples
        if s.name == metric_names.LORA_REQUESTS_RECEIVED
    }
    loaded = {
        s.labels[metric_names.LORA_NAME_LABEL]: s.value
        for s in samples
        if s.name == metric_names.LORA_ADAPTER_LOADED
    }
    assert received == {"a": 2.0, "b": 0.0}
    assert loaded == {"a": 1.0, "b": 1.0}
