"""Each adapter's demand for the placement: the PromQL and its answer (tables), and a real
Prometheus scraping two exporters of the runtime's own metrics module (adapters/demand.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpilot.operator.adapters import demand
from kvpilot.operator.autoscaling import metrics_reader
from kvpilot.runtime.engine.stats import EngineStats
from kvpilot.runtime.server.metrics import ServerMetrics
from tests.support.kube import wait_until
from tests.support.prometheus_process import (
    HAS_PROMETHEUS,
    running_prometheus,
    runtime_exporter,
    scrape_config,
)

NAMESPACE, MODEL = "serving", "tiny-llama"


def test_demand_query() -> None:
    assert demand.demand_query("ns", "md", 600) == (
        'sum by (lora_name) (rate({__name__="kvpilot_lora_requests_received_total",'
        'namespace="ns",kvpilot_model="md"}[10m]))'
    )


@pytest.mark.parametrize(
    ("vector", "expected"),
    [
        ([], {}),
        (
            [
                {"metric": {"lora_name": "sql"}, "value": [1.7e9, "2.5"]},
                {"metric": {"lora_name": "chat"}, "value": [1.7e9, "0"]},
                {"metric": {"lora_name": "odd"}, "value": [1.7e9, "NaN"]},  # no rate yet
            ],
            {"sql": 2.5, "chat": 0.0},
        ),
    ],
)
def test_from_vector(vector: list[dict[str, object]], expected: dict[str, float]) -> None:
    assert demand.from_vector(vector) == expected


def serve_runtime() -> tuple[int, ServerMetrics, Callable[[], None]]:
    return runtime_exporter(MODEL, EngineStats(0, 0, 100, 50, 0.5, 0, 0, 0, max_lora=2))


@pytest.mark.skipif(not HAS_PROMETHEUS, reason="needs Debian's prometheus binary")
def test_each_adapters_rate_summed_over_the_pods(tmp_path: Path) -> None:
    # pod-a serves sql 4/s and chat 1/s, pod-b sql 2/s: sql 6/s and chat 1/s in all
    per_s = {"pod-a": {"sql": 4, "chat": 1}, "pod-b": {"sql": 2}}
    pods = {name: serve_runtime() for name in per_s}
    labels = {
        metrics_reader.PROM_LABEL_NAMESPACE: NAMESPACE,
        metrics_reader.PROM_LABEL_MODEL: MODEL,
        metrics_reader.PROM_LABEL_NODE_TYPE: "h100",
    }
    targets = {
        name: (port, {**labels, metrics_reader.PROM_LABEL_POD: name})
        for name, (port, _, _) in pods.items()
    }
    done = threading.Event()

    def serve_requests() -> None:  # every 0.1 s, each pod counts the requests due by then
        owed = {(name, a): 0.0 for name, rates in per_s.items() for a in rates}
        while not done.wait(0.1):
            for (name, adapter), carried in owed.items():
                due = carried + per_s[name][adapter] * 0.1
                owed[name, adapter] = due - int(due)
                if int(due):
                    pods[name][1].record_lora_received(adapter, int(due))

    traffic = threading.Thread(target=serve_requests, daemon=True)
    traffic.start()
    try:
        with running_prometheus(scrape_config(targets), tmp_path) as url:
            source = demand.PrometheusDemand(url, timeout_s=2.0, window_s=5)
            assert source.read("other", MODEL) is None  # no series: the pods' counters decide

            def filled() -> dict[str, float] | None:
                rates = source.read(NAMESPACE, MODEL)
                return rates if rates and rates.get("sql", 0) > 5 else None

            rates = wait_until(filled, timeout_s=40, what="a window of rates")
    finally:
        done.set()
        traffic.join(timeout=5)
        for _, _, stop in pods.values():
            stop()
    assert set(rates) == {"sql", "chat"}
    assert 5 < rates["sql"] < 7.5 and 0.7 < rates["chat"] < 1.5, rates
    assert demand.PrometheusDemand("http://127.0.0.1:1").read(NAMESPACE, MODEL) is None
