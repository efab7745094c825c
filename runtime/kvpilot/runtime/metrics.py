"""The runtime's Prometheus metrics (DESIGN.md §3.4): each under its kvpilot name AND vLLM alias.

The aliases let vLLM dashboards, KEDA triggers and the Gateway API Inference Extension read kvpilot
pods unchanged. Queue length, running batch, KV usage, prefix-cache and preemption counts are the
autoscaler's inputs, so they are not copied into gauges after each step (a scrape could then see a
stale value): a custom collector reads the engine's stats at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Buckets as vLLM uses them, so histogram_quantile over either name gives the same answer.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
LABEL = "model_name"


@dataclass(frozen=True)
class Snapshot:
    """What the collector needs at scrape time (built from EngineStats plus server counts)."""

    num_waiting: int
    num_running: int
    kv_cache_usage: float
    num_total_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


# (kvpilot name, vLLM alias, help, Snapshot field)
GAUGES = [
    (
        "kvpilot_requests_waiting",
        "vllm:num_requests_waiting",
        "Requests queued, not yet scheduled.",
        "num_waiting",
    ),
    (
        "kvpilot_requests_running",
        "vllm:num_requests_running",
        "Requests in the running batch.",
        "num_running",
    ),
    (
        "kvpilot_kv_cache_usage_ratio",
        "vllm:kv_cache_usage_perc",
        "Used KV-cache blocks / total blocks (0-1).",
        "kv_cache_usage",
    ),
]
COUNTERS = [
    (
        "kvpilot_prefix_cache_queries",
        "vllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queries",
    ),
    (
        "kvpilot_prefix_cache_hits",
        "vllm:prefix_cache_hits",
        "Prompt tokens served from the prefix cache.",
        "prefix_cache_hits",
    ),
    (
        "kvpilot_preemptions",
        "vllm:num_preemptions",
        "Sequences preempted to free KV-cache blocks.",
        "num_preemptions",
    ),
]
BLOCK_GAUGES = [  # kvpilot only: lets tests and operators see the pool itself
    ("kvpilot_kv_cache_total_blocks", "KV-cache blocks in the pool.", "num_total_blocks"),
    ("kvpilot_kv_cache_free_blocks", "KV-cache blocks free.", "num_free_blocks"),
]


class EngineStatsCollector(Collector):
    def __init__(self, model_name: str, snapshot: Callable[[], Snapshot]):
        self.model_name = model_name
        self.snapshot = snapshot

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        snap = self.snapshot()
        for name, alias, text, attr in GAUGES:
            for metric in (name, alias):
                family = GaugeMetricFamily(metric, text, labels=[LABEL])
                family.add_metric([self.model_name], float(getattr(snap, attr)))
                yield family
        for name, alias, text, attr in COUNTERS:
            for metric in (name, alias):
                counter = CounterMetricFamily(metric, text, labels=[LABEL])
                counter.add_metric([self.model_name], float(getattr(snap, attr)))
                yield counter
        for name, text, attr in BLOCK_GAUGES:
            family = GaugeMetricFamily(name, text, labels=[LABEL])
            family.add_metric([self.model_name], float(getattr(snap, attr)))
            yield family


class _Pair:
    """One observation recorded under the kvpilot name and the vLLM alias."""

    def __init__(self, metrics: list[Histogram] | list[Counter], model_name: str):
        self.children = [m.labels(model_name) for m in metrics]

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)  # type: ignore[union-attr]

    def inc(self, value: float) -> None:
        for child in self.children:
            child.inc(value)  # type: ignore[union-attr]


class ServerMetrics:
    """Histograms and counters the HTTP layer records, plus the scrape-time engine collector."""

    def __init__(self, model_name: str, snapshot: Callable[[], Snapshot]):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        h, c = self._histograms, self._counters
        self.ttft = h("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = c("generation_tokens", "Tokens generated.")
        self.success = [
            Counter(
                name,
                "Finished requests by finish reason.",
                [LABEL, "finished_reason"],
                registry=self.registry,
            )
            for name in ("kvpilot_request_success", "vllm:request_success")
        ]
        self.steps = Counter("kvpilot_engine_steps", "Engine steps run.", [LABEL],
                             registry=self.registry).labels(model_name)  # fmt: skip
        self.registry.register(EngineStatsCollector(model_name, snapshot))

    def _histograms(self, name: str, text: str, buckets: tuple[float, ...]) -> _Pair:
        metrics = [
            Histogram(full, text, [LABEL], buckets=buckets, registry=self.registry)
            for full in (f"kvpilot_{name}", f"vllm:{name}")
        ]
        return _Pair(metrics, self.model_name)

    def _counters(self, name: str, text: str) -> _Pair:
        metrics = [
            Counter(full, text, [LABEL], registry=self.registry)
            for full in (f"kvpilot_{name}", f"vllm:{name}")
        ]
        return _Pair(metrics, self.model_name)

    def record_finished(self, e2e_s: float, num_prompt: int, num_output: int, reason: str) -> None:
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_output)
        for counter in self.success:
            counter.labels(self.model_name, reason).inc()

    def on_step(self, *_: object) -> None:
        """Engine step listener (runs on the engine's thread; counters are thread-safe)."""
        self.steps.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
