"""The metrics adapter against a real Prometheus scraping real exporters, feeding the policy.

The test serves three "pods" with prometheus_client on 127.0.0.1 (one exporting kvpilot's names
and their vLLM aliases, as the runtime does; one kvpilot-only; one vLLM-only), starts Debian's
Prometheus on a free port with static targets carrying the labels kubernetes_sd relabelling
would add, and reads observations through PromQL. Then one pod goes away, then Prometheus does.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.operator.autoscaling import metrics_reader as metrics
from kvpilot.operator.autoscaling.metrics_reader import PrometheusMetrics, observe_pods
from kvpilot.operator.autoscaling.policy import Bounds, Observations, PolicyState, decide
from kvpilot.runtime.engine.sequence import Timestamps
from kvpilot.runtime.engine.stats import EngineStats
from kvpilot.runtime.server.metrics import ServerMetrics
from tests.support.kube import wait_until
from tests.support.prometheus_process import (
    running_prometheus,
    runtime_exporter,
    scrape_config,
    started_prometheus,
)
from tests.support.server_process import free_port

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="needs Debian's prometheus binary"
)

NAMESPACE, MODEL = "serving", "tiny-llama"
BOUNDS = Bounds(min_replicas=1, max_replicas=10, target_queue_length=3.0)


@dataclass
class Pod:
    name: str
    node_type: str
    port: int
    gauges: dict[str, Gauge]
    stop: Callable[[], None]
    ttft: Histogram | None = None

    def set(self, **values: float) -> None:
        for key, value in values.items():
            for gauge in (g for name, g in self.gauges.items() if name.startswith(key)):
                gauge.labels(model_name=MODEL).set(value)


def serve_pod(name: str, node_type: str, names: dict[str, list[str]]) -> Pod:
    registry = CollectorRegistry()
    gauges = {}
    for key, metric_names in names.items():
        for i, metric in enumerate(metric_names):
            gauges[f"{key}{i}"] = Gauge(metric, key, ["model_name"], registry=registry)
    ttft = None
    if "ttft" in names:
        ttft = Histogram(
            "kvpilot_time_to_first_token_seconds", "ttft", ["model_name"], registry=registry
        )
        ttft.labels(model_name=MODEL)  # the series exist at zero, so a later rate sees growth
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return Pod(name, node_type, port, gauges, stop, ttft)


@pytest.fixture()
def pods() -> Iterator[dict[str, Pod]]:
    both = {
        "waiting": ["kvpilot_requests_waiting", "vllm:num_requests_waiting"],
        "running": ["kvpilot_requests_running", "vllm:num_requests_running"],
        "kv": ["kvpilot_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"],
        "ttft": [],
    }
    kvpilot_only = {key: names[:1] for key, names in both.items() if key != "ttft"}
    vllm_only = {key: names[1:] for key, names in both.items() if key != "ttft"}
    served = {
        "pod-a": serve_pod("pod-a", "h100", both),
        "pod-b": serve_pod("pod-b", "h100", kvpilot_only),
        "pod-c": serve_pod("pod-c", "a100", vllm_only),
    }
    served["pod-a"].set(waiting=2, running=10, kv=0.9)
    served["pod-b"].set(waiting=1, running=8, kv=0.7)
    served["pod-c"].set(waiting=0, running=6, kv=0.5)
    yield served
    for pod in served.values():
        with contextlib.suppress(OSError):
            pod.stop()


def prometheus_config(pods: dict[str, Pod]) -> dict[str, Any]:
    """Each pod with the labels kubernetes_sd relabelling gives it."""
    labels = {
        metrics.PROM_LABEL_NAMESPACE: NAMESPACE,
        metrics.PROM_LABEL_MODEL: MODEL,
    }
    return scrape_config(
        {
            pod.name: (
                pod.port,
                {
                    **labels,
                    metrics.PROM_LABEL_POD: pod.name,
                    metrics.PROM_LABEL_NODE_TYPE: pod.node_type,
                },
            )
            for pod in pods.values()
        }
    )


@pytest.fixture()
def prometheus(
    pods: dict[str, Pod], tmp_path: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with started_prometheus(prometheus_config(pods), tmp_path) as started:
        yield started


def observe(source: PrometheusMetrics, current: int = 3) -> Observations:
    return source.observe(NAMESPACE, MODEL, current_replicas=current)


def observe_until(
    source: PrometheusMetrics, what: str, done: Callable[[Observations], bool]
) -> Observations:
    last: list[Observations] = []

    def probe() -> Observations | None:
        last[:] = [observe(source)]
        return last[0] if done(last[0]) else None

    try:
        return wait_until(probe, timeout_s=30, what=what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last observations: {last}") from None


def test_promql_observations_feed_the_policy(
    pods: dict[str, Pod],
    prometheus: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, process = prometheus
    source = PrometheusMetrics(url, timeout_s=2.0)
    seen = observe_until(source, "all three pods", lambda o: o.ready_replicas == 3)
    # pod-a exports both names with the same values: counted once
    assert seen.requests_waiting == 3
    assert seen.requests_running == 24
    assert seen.kv_cache_usage == pytest.approx(0.7)
    assert time.time() - (seen.sampled_at or 0) < 10
    # TTFT p95 is a rate over the histogram: it needs requests between two scrapes
    assert seen.ttft_p95_s is None
    ttft = pods["pod-a"].ttft
    assert ttft is not None
    for seconds in [0.2] * 19 + [3.0]:
        ttft.labels(model_name=MODEL).observe(seconds)
    timed = observe_until(source, "TTFT p95", lambda o: o.ttft_p95_s is not None)
    assert timed.ttft_p95_s is not None and 0.1 < timed.ttft_p95_s <= 0.25
    held = decide(seen, BOUNDS, PolicyState(), time.time())
    assert held.metrics_available and held.replicas == 3

    by_type = metrics.aggregate_by_node_type(
        source.pod_samples(NAMESPACE, MODEL), {"h100": 2, "a100": 1}, time.time()
    )
    assert by_type["h100"].requests_running == 18
    assert by_type["a100"].ready_replicas == 1

    # a queue builds on pod-b: 30 + 2 waiting over 3 ready is above the target of 3 per replica,
    # so every request in flight gets a running slot: ceil(3 x (24 running + 32) / 24) = 7
    pods["pod-b"].set(waiting=30)
    busy = observe_until(source, "queue", lambda o: o.requests_waiting == 32)
    up = decide(busy, BOUNDS, held.state, time.time())
    assert up.replicas == 7, up.reason
    assert "queue" in up.reason

    # a ready-pod filter leaves pods that are not ready out of the capacity
    partial = source.observe(NAMESPACE, MODEL, 3, ready_pods={"pod-a", "pod-c"})
    assert partial.ready_replicas == 2 and partial.requests_waiting == 2

    # pod-c goes away: Prometheus marks its series stale and it stops counting
    pods["pod-c"].stop()
    two = observe_until(source, "pod-c stale", lambda o: o.ready_replicas == 2)
    assert two.requests_running == 18

    # Prometheus goes away: observations unavailable, the policy holds and flags it
    process.terminate()
    process.wait(timeout=30)
    gone = observe(source, current=7)
    assert gone.error.startswith("prometheus:")
    hold = decide(gone, BOUNDS, up.state, time.time())
    assert hold.replicas == 7
    assert not hold.metrics_available
    assert "never scale down" in hold.reason


def test_direct_scrape_of_ready_pods(pods: dict[str, Pod]) -> None:
    import asyncio

    # a "pod" that accepts connections and never answers: it must time out, not block the rest
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}/metrics"
        urls = {name: f"http://127.0.0.1:{pod.port}/metrics" for name, pod in pods.items()}
        urls["pod-hung"] = hung_url
        node_types = {name: pod.node_type for name, pod in pods.items()}
        seen = asyncio.run(observe_pods(urls, node_types, current_replicas=4, timeout_s=1.0))
    assert seen.ready_replicas == 3
    assert seen.requests_waiting == 3
    assert seen.kv_cache_usage == pytest.approx(0.7)
    assert decide(seen, BOUNDS, PolicyState(), time.time()).metrics_available

    for pod in pods.values():
        pod.stop()
    down = asyncio.run(observe_pods(urls, node_types, current_replicas=4, timeout_s=1.0))
    assert "none of 4 pods answered" in down.error
    assert decide(down, BOUNDS, PolicyState(), time.time()).replicas == 4


def serve_runtime(running: int) -> tuple[int, ServerMetrics, Callable[[], None]]:
    """The runtime's exporter (both names of every series), its engine running `running`."""
    return runtime_exporter(MODEL, EngineStats(0, running, 100, 50, 0.5, 0, 0, 0))


def test_fleet_rates_from_the_runtimes_counters(tmp_path: Path) -> None:
    # Two runtime pods, as the runtime exports them (kvpilot's names and vLLM's): one receives
    # and finishes 5 requests a second of 10 tokens each, the other 3; the fleet's rates are
    # their sums, each pod counted once although it exports every counter twice. The windows
    # are seconds long so that they fill while the test runs (rate() divides by the whole range).
    pods = {"pod-a": (5, serve_runtime(running=10)), "pod-b": (3, serve_runtime(running=4))}
    first_token_s = {"pod-a": 0.3, "pod-b": 2.0}  # so 5 of every 8 requests get 1 s TTFT
    # Requests of 10 tokens over 0.18 s (pod-a) or 0.9 s (pod-b) of decode: TPOT 0.02 or 0.1 s
    decode_s = {"pod-a": 0.18, "pod-b": 0.9}
    static = [
        {
            "targets": [f"127.0.0.1:{port}"],
            "labels": {
                metrics.PROM_LABEL_NAMESPACE: NAMESPACE,
                metrics.PROM_LABEL_POD: name,
                metrics.PROM_LABEL_MODEL: MODEL,
                metrics.PROM_LABEL_NODE_TYPE: "h100",
            },
        }
        for name, (_, (port, _, _)) in pods.items()
    ]
    settings = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "kvpilot-pods", "static_configs": static}],
    }
    done = threading.Event()

    def serve_requests() -> None:
        owed = dict.fromkeys(pods, 0.0)  # requests due on each pod, fractions carried over
        while not done.wait(0.1):
            for name, (per_s, (_, runtime, _)) in pods.items():
                owed[name] += per_s * 0.1
                while owed[name] >= 1:
                    owed[name] -= 1
                    runtime.record_received()
                    runtime.ttft.observe(first_token_s[name])
                    first, last = first_token_s[name], first_token_s[name] + decode_s[name]
                    runtime.record_phases(Timestamps(0.0, 0.0, first, last), num_output=10)
                    runtime.record_finished(1.0, 5, 10, "stop")

    traffic = threading.Thread(target=serve_requests, daemon=True)
    traffic.start()
    windows = metrics.RateWindows(short_s=4, long_s=8, minute_s=4)
    try:
        with running_prometheus(settings, tmp_path) as url:
            source = PrometheusMetrics(url, timeout_s=2.0, windows=windows)

            def filled() -> metrics.FleetRates | None:
                time.sleep(0.5)
                rates = source.fleet_rates(NAMESPACE, MODEL)
                return rates if (rates.arrivals_long_per_s or 0.0) > 6.5 else None

            rates = wait_until(filled, timeout_s=30, what="the long window filled")
            # observe() reads the rates and the attainment only for a fleet with a TTFT SLO.
            plain = source.observe(NAMESPACE, MODEL, current_replicas=2)
            sized = source.observe(NAMESPACE, MODEL, current_replicas=2, slo_ttft_s=1.0)
            # the runtime's per-request TPOT histogram, read under the name the contract gives
            streamed = source.observe(
                NAMESPACE, MODEL, current_replicas=2, slo_ttft_s=1.0, slo_tpot_s=0.05
            )
            # 0.4 s lies inside the bucket (0.25, 0.5]: pod-a's 0.3 s are placed linearly in it.
            inside = source.ttft_attainment(NAMESPACE, MODEL, 0.4)
            everyone = source.ttft_attainment(NAMESPACE, MODEL, 3.0)
    finally:
        done.set()
        for _, (_, _, stop) in pods.values():
            stop()
    # 8/s give or take a scrape's worth; 16/s (both names counted) or 5/s (one pod) would not.
    for rate in (rates.arrivals_short_per_s, rates.arrivals_long_per_s, rates.completions_per_s):
        assert rate is not None and 6.5 < rate < 10, rates
    assert rates.tokens_per_s == pytest.approx(10 * (rates.completions_per_s or 0), rel=0.01)
    assert rates.requests_running_1m == 14  # 10 + 4, each pod once
    assert plain.ready_replicas == 2 and plain.arrivals_long_per_s is None
    assert plain.completions_per_s is None and plain.requests_running_1m is None
    assert sized.arrivals_long_per_s is not None and 6.5 < sized.arrivals_long_per_s < 10
    assert sized.requests_running_1m == 14
    assert plain.ttft_slo_attainment is None
    assert sized.ttft_slo_attainment == pytest.approx(5 / 8, abs=0.05)
    assert sized.tpot_slo_attainment is None  # not read without a TPOT target
    assert streamed.tpot_slo_attainment == pytest.approx(5 / 8, abs=0.05)
    assert inside is not None and inside.share == pytest.approx(0.6 * 5 / 8, abs=0.05)
    assert everyone is not None and everyone.share == 1.0


def serve_gateway(
    held: dict[tuple[str, str, str], float],
) -> tuple[int, GatewayMetrics, Callable[[], None]]:
    """A gateway replica's exporter: kvpilot-gateway's own metrics (names, labels, types), its
    held gauge set per (md_namespace, md_name, model)."""
    gateway = GatewayMetrics()
    for labels, value in held.items():
        gateway.held.labels(*labels).set(value)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=gateway.registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return port, gateway, stop


def gateway_scrape(ports: dict[str, int]) -> list[dict[str, Any]]:
    """Gateway pods as the relabelling labels them: their own namespace and pod name."""
    return [
        {
            "targets": [f"127.0.0.1:{port}"],
            "labels": {metrics.PROM_LABEL_NAMESPACE: "kvpilot-system", metrics.PROM_LABEL_POD: pod},
        }
        for pod, port in ports.items()
    ]


def holding(source: PrometheusMetrics, count: float, what: str) -> Observations:
    def probe() -> Observations | None:
        seen = source.observe(NAMESPACE, MODEL, 0)
        return seen if seen.requests_held == count else None

    return wait_until(probe, timeout_s=30, what=what)


def test_requests_held_at_gateways_wake_a_modeldeployment_at_zero(tmp_path: Path) -> None:
    # Two gateway replicas in their own namespace; the scrape labels them with it, as the
    # Kubernetes relabelling does, so only md_namespace/md_name say which ModelDeployment waits.
    ours = (NAMESPACE, MODEL, "tiny-llama")
    first_port, first, stop_first = serve_gateway({ours: 2, ("other", MODEL, "tiny-llama"): 50})
    second_port, second, stop_second = serve_gateway({ours: 1, (NAMESPACE, "other", "x"): 40})
    static = gateway_scrape({"gateway-a": first_port, "gateway-b": second_port})
    settings = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "kvpilot-gateway", "static_configs": static}],
    }
    bounds = Bounds(min_replicas=0, max_replicas=4, target_queue_length=2.0)
    try:
        with running_prometheus(settings, tmp_path) as url:
            source = PrometheusMetrics(url, timeout_s=2.0)
            held = holding(source, 3, "3 requests held over both gateways")
            assert held.requests_waiting == 3 and held.error == "" and held.ready_replicas == 0
            up = decide(held, bounds, PolicyState(), time.time())
            assert up.replicas == 2, up.reason  # ceil(3 held / 2 per replica), from zero
            assert "3 waiting, 0 ready" in up.reason

            first.held.labels(*ours).set(0)
            second.held.labels(*ours).set(0)
            drained = holding(source, 0, "nothing held")
            assert decide(drained, bounds, PolicyState(), time.time()).replicas == 0
    finally:
        stop_first()
        stop_second()


def test_the_gateways_fair_queue_and_arrivals_size_a_saturated_fleet(tmp_path: Path) -> None:
    # Flow control on: the replica (the runtime's own exporter) receives 2 requests a second,
    # all it serves, and queues nothing; the gateway (its own metrics) sees 6 a second arrive
    # and keeps 12 in its fair queue. The operator reads the queue as waiting demand and the
    # gateway's arrivals as the rate, where the runtime's figures alone show a fleet at ease.
    runtime_port, runtime, stop_runtime = serve_runtime(running=10)
    gateway_port, gateway, stop_gateway = serve_gateway({})
    ours = (NAMESPACE, MODEL, "tiny-llama")
    gateway.queued.labels(*ours).set(12)
    gateway.arrived.labels(*ours)  # at zero, so that the first increments count in rate()
    pod_labels = {
        metrics.PROM_LABEL_NAMESPACE: NAMESPACE,
        metrics.PROM_LABEL_POD: "pod-a",
        metrics.PROM_LABEL_MODEL: MODEL,
        metrics.PROM_LABEL_NODE_TYPE: "h100",
    }
    static = [{"targets": [f"127.0.0.1:{runtime_port}"], "labels": pod_labels}]
    settings = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "kvpilot-pods", "static_configs": static},
            {"job_name": "kvpilot-gateway",
             "static_configs": gateway_scrape({"gateway-a": gateway_port})},
        ],
    }  # fmt: skip
    done = threading.Event()

    def arrive() -> None:
        while not done.wait(0.5):
            gateway.arrived.labels(*ours).inc(3)
            runtime.record_received()

    traffic = threading.Thread(target=arrive, daemon=True)
    traffic.start()
    windows = metrics.RateWindows(short_s=4, long_s=8, minute_s=4)
    try:
        with running_prometheus(settings, tmp_path) as url:
            source = PrometheusMetrics(url, timeout_s=2.0, windows=windows)

            def filled() -> Observations | None:
                time.sleep(0.5)
                seen = source.observe(NAMESPACE, MODEL, current_replicas=1, slo_ttft_s=2.0)
                long = seen.arrivals_long_per_s or 0.0
                return seen if long > 4.5 and seen.requests_queued == 12 else None

            seen = wait_until(filled, timeout_s=30, what="the gateway's arrivals and queue")
            runtime_only = source.fleet_rates(NAMESPACE, MODEL)
    finally:
        done.set()
        stop_runtime()
        stop_gateway()
    assert seen.requests_waiting == 12 and seen.ready_replicas == 1  # 0 at the replica
    assert seen.arrivals_short_per_s is not None and 4.5 < seen.arrivals_short_per_s < 7.5
    runtime_rate = runtime_only.arrivals_long_per_s
    assert runtime_rate is not None and runtime_rate < 2.5  # what the runtime alone shows
    gateway_rate = runtime_only.gateway_arrivals_long_per_s
    assert gateway_rate is not None and gateway_rate > 4.5
    # The queue guard sees 12 waiting on one replica (target 4): a running slot for each.
    bounds = Bounds(min_replicas=1, max_replicas=10)
    up = decide(seen, bounds, PolicyState(), time.time())
    assert up.replicas == 3 and "12 waiting" in up.reason, up.reason  # ceil((10 + 12) / 10)
