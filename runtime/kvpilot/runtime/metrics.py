"""The runtime's Prometheus metrics (docs/architecture.md §3.4): each under its kvpilot name AND
vLLM alias, with vLLM's types, buckets and `model_name` label (vllm/v1/metrics/loggers.py).

The aliases let vLLM dashboards, KEDA triggers and the Gateway API Inference Extension read kvpilot
pods unchanged. Queue length, running batch, KV usage, prefix-cache and preemption counts are the
autoscaler's inputs, so they are not copied into gauges after each step (a scrape could then see a
stale value): a custom collector reads the engine's stats at scrape time. The per-request phase
times (queue, prefill, decode) come from the engine's own timestamps (sequence.Timestamps).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpilot.runtime.sequence import Timestamps

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
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LABEL = "model_name"
# vLLM's per-request phases (request_{phase}_time_seconds), on the engine's clock
PHASES = {
    "queue": "Time waiting to be first scheduled.",
    "prefill": "First scheduled to first token.",
    "decode": "First token to last token.",
    "inference": "First scheduled to last token (prefill + decode).",
}
ENGINE_INDEX = "0"  # vLLM's `engine` label: one engine core per kvpilot process


def buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: vLLM's buckets for per-request token counts."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class CacheInfo:
    """What `vllm:cache_config_info` states about the KV pool; the Inference Extension's endpoint
    picker reads block_size and num_gpu_blocks from its labels."""

    block_size: int
    num_gpu_blocks: int
    cache_dtype: str
    enable_prefix_caching: bool
    gpu_memory_utilization: float

    def labels(self) -> dict[str, str]:
        # vLLM writes each config value with str(): booleans as True/False
        return {name: str(value) for name, value in self.__dict__.items()}


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


class StepStats(Protocol):
    """What the step listener reads of the engine's stats."""

    @property
    def num_step_tokens(self) -> int: ...


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


class InfoCollector(Collector):
    """The info-style gauges vLLM sets to a constant: `vllm:cache_config_info` (1, once the
    pool is sized) and `vllm:lora_requests_info`, whose value is the time of the reading (the
    endpoint picker takes the newest) and whose adapter lists are empty: kvpilot serves no LoRA
    adapters, and says so the way a vLLM without adapters loaded does."""

    def __init__(self, model_name: str, max_loras: int = 0):
        self.model_name, self.max_loras = model_name, max_loras
        self.cache: CacheInfo | None = None

    def collect(self) -> Iterable[GaugeMetricFamily]:
        if self.cache is not None:
            labels = {LABEL: self.model_name, "engine": ENGINE_INDEX, **self.cache.labels()}
            yield self._info("vllm:cache_config_info", "Information of the KV cache.", labels, 1)
        lora = {
            LABEL: self.model_name,
            "max_lora": str(self.max_loras),
            "running_lora_adapters": "",
            "waiting_lora_adapters": "",
        }
        yield self._info(
            "vllm:lora_requests_info", "Running stats on LoRA requests.", lora, time.time()
        )

    @staticmethod
    def _info(name: str, text: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, text, labels=list(labels))
        family.add_metric(list(labels.values()), value)
        return family


class _Pair:
    """One observation recorded under the kvpilot name and the vLLM alias (or aliases)."""

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
        # vLLM's older name for the same per-token interval, which its dashboards still chart
        self.itl = h(
            "inter_token_latency_seconds",
            "Time between output tokens.",
            ITL_BUCKETS,
            aliases=("vllm:time_per_output_token_seconds",),
        )
        self.e2e = h("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.phases = {
            phase: h(f"request_{phase}_time_seconds", text, E2E_BUCKETS)
            for phase, text in PHASES.items()
        }
        # vLLM's name ends in _total although it is a histogram; kvpilot's own name does not
        self.iteration_tokens = h(
            "iteration_tokens",
            "Tokens run per engine step.",
            ITERATION_TOKENS_BUCKETS,
            vllm_name="vllm:iteration_tokens_total",
        )
        self.request_tokens: tuple[_Pair, _Pair] | None = None  # buckets need max_model_len
        self.info = InfoCollector(model_name)
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
        self.registry.register(self.info)

    def _histograms(
        self,
        name: str,
        text: str,
        buckets: tuple[float, ...],
        aliases: tuple[str, ...] = (),
        vllm_name: str = "",
    ) -> _Pair:
        names = (f"kvpilot_{name}", vllm_name or f"vllm:{name}", *aliases)
        metrics = [
            Histogram(full, text, [LABEL], buckets=buckets, registry=self.registry)
            for full in names
        ]
        return _Pair(metrics, self.model_name)

    def on_engine_ready(self, max_model_len: int, cache: CacheInfo) -> None:
        """Once the engine is loaded: the pool's facts, and the per-request token histograms,
        whose buckets (as vLLM's) run up to max_model_len."""
        self.info.cache = cache
        buckets = buckets_1_2_5(max_model_len)
        self.request_tokens = (
            self._histograms("request_prompt_tokens", "Prompt tokens per request.", buckets),
            self._histograms("request_generation_tokens", "Tokens generated per request.", buckets),
        )

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
        if self.request_tokens is not None:
            self.request_tokens[0].observe(num_prompt)
            self.request_tokens[1].observe(num_output)

    def record_phases(self, times: Timestamps) -> None:
        """Queue, prefill, decode and inference time of a finished request; a request that
        ended before it was scheduled or before its first token has no such phases."""
        if times.scheduled is None:
            return
        self.phases["queue"].observe(times.scheduled - times.queued)
        if times.first_token is None or times.last_token is None:
            return
        self.phases["prefill"].observe(times.first_token - times.scheduled)
        self.phases["decode"].observe(times.last_token - times.first_token)
        self.phases["inference"].observe(times.last_token - times.scheduled)

    def on_step(self, _outputs: object, stats: StepStats) -> None:
        """Engine step listener (runs on the engine's thread; metrics are thread-safe)."""
        self.steps.inc()
        if stats.num_step_tokens:
            self.iteration_tokens.observe(stats.num_step_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
