"""The pure parts of the runtime's metrics: vLLM's 1-2-5 buckets, the engine's timestamps, and
which phases a request that ended early has."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.contract.priority import label as priority_label
from kvpilot.runtime.engine.sequence import Timestamps
from kvpilot.runtime.engine.stats import EngineStats
from kvpilot.runtime.server.metrics import ServerMetrics, buckets_1_2_5


@pytest.mark.parametrize(
    ("max_value", "buckets"),
    [
        (1, (1,)),
        (4, (1, 2)),
        (100, (1, 2, 5, 10, 20, 50, 100)),
        (2048, (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)),
    ],
)
def test_buckets_1_2_5(max_value: int, buckets: tuple[int, ...]) -> None:
    assert buckets_1_2_5(max_value) == buckets


def test_timestamps_keep_the_first_schedule_and_the_last_token() -> None:
    times = Timestamps(queued=1.0)
    for now in (2.0, 5.0):  # scheduled again after a preemption: the first one counts
        times.on_scheduled(now)
    for now in (3.0, 4.0, 6.0):
        times.on_token(now)
    assert (times.scheduled, times.first_token, times.last_token) == (2.0, 3.0, 6.0)


def phase_counts(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm:request_") and s.name.endswith("_time_seconds_count")
    }


@pytest.mark.parametrize(
    ("times", "observed"),
    [
        (Timestamps(queued=1.0), set()),  # aborted while queued: no phase at all
        (Timestamps(queued=1.0, scheduled=2.0), {"queue"}),  # aborted during its prefill
        (Timestamps(1.0, 2.0, 3.0, 3.0), {"queue", "prefill", "decode", "inference"}),
    ],
)
def test_phases_of_a_request_that_ended(times: Timestamps, observed: set[str]) -> None:
    metrics = ServerMetrics("m", EngineStats.idle)
    metrics.record_phases(times)
    counts = phase_counts(metrics)
    assert {name.split("_")[1] for name, value in counts.items() if value == 1} == observed
    assert len(counts) == 4


@pytest.mark.parametrize(
    ("num_output", "tpot"),
    [(0, None), (1, None), (2, 2.0), (5, 0.5)],  # decode 3.0 -> 5.0: 2 s over the tokens after one
)
def test_time_per_output_token_of_a_request(num_output: int, tpot: float | None) -> None:
    metrics = ServerMetrics("m", EngineStats.idle)
    metrics.record_phases(Timestamps(1.0, 2.0, 3.0, 5.0), num_output=num_output)
    found = samples(metrics)
    series = (("model_name", "m"),)
    count = found[("kvpilot_request_time_per_output_token_seconds_count", series)]
    assert count == (0 if tpot is None else 1)
    if tpot is not None:
        assert found[("vllm:request_time_per_output_token_seconds_sum", series)] == tpot


@pytest.mark.parametrize(
    ("priority", "label"),
    [(0, "0"), (-9, "-9"), (9, "9"), (10, ">=10"), (2**63 - 1, ">=10"), (-10, "<=-10")],
)
def test_priority_label_is_bounded(priority: int, label: str) -> None:
    assert priority_label(priority) == label


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_ttft_and_queue_time_by_priority() -> None:
    metrics = ServerMetrics("m", EngineStats.idle)
    metrics.record_ttft(0.5, priority=-1)
    metrics.record_phases(Timestamps(queued=1.0, scheduled=3.0), priority=42)
    found = samples(metrics)
    ttft = ("kvpilot_time_to_first_token_by_priority_seconds_sum",
            (("model_name", "m"), ("priority", "-1")))  # fmt: skip
    queue = ("kvpilot_request_queue_time_by_priority_seconds_sum",
             (("model_name", "m"), ("priority", ">=10")))  # fmt: skip
    assert (found[ttft], found[queue]) == (0.5, 2.0)
    assert found[("vllm:time_to_first_token_seconds_count", (("model_name", "m"),))] == 1


def test_preemptions_by_reason_add_up_to_the_total() -> None:
    stats = EngineStats(0, 0, 8, 8, 0.0, 0, 0, 3, preemptions_by_reason=(("priority", 3),))
    found = samples(ServerMetrics("m", lambda: stats))
    by_reason = {
        dict(labels)["reason"]: value
        for (name, labels), value in found.items()
        if name == "kvpilot_preemptions_by_reason_total"
    }
    assert by_reason == {"kv_cache": 0, "priority": 3}
    assert found[("vllm:num_preemptions_total", (("model_name", "m"),))] == 3


def test_lora_loads_and_evictions_are_counters() -> None:
    stats = EngineStats(0, 0, 8, 8, 0.0, 0, 0, 0, lora_loads=5, lora_evictions=2)
    found = samples(ServerMetrics("m", lambda: stats))
    model = (("model_name", "m"),)
    loads, evictions = ("kvpilot_lora_loads_total", model), ("kvpilot_lora_evictions_total", model)
    assert (found[loads], found[evictions]) == (5, 2)
