"""Metrics adapter: the autoscaling policy's observations, from Prometheus or from the pods.

With a Prometheus URL the adapter runs a few PromQL queries per ModelDeployment (grouped by pod
and node type) and checks how old the newest samples are; without one it scrapes the ready pods'
/metrics directly, concurrently, each with a timeout. Either way the result goes through the
same pure `aggregate`, so not-ready pods and stale samples are treated alike.

Engine-agnostic: every signal is looked up under kvpilot's name first and vLLM's alias second
(DESIGN.md §3.4), so vLLM pods are scaled the same way. The runtime exports both names; taking
the first one found per pod never counts a pod twice.

KV-cache usage is averaged over the last minute (PromQL avg_over_time) because one sample is
noisy (a few long requests move it by 10%); queue length is taken as is, so bursts act fast.

A TTFT SLO also needs the fleet's rates (`FleetRates`): arrivals over the forecaster's two windows,
and completions, output tokens and the running count over the minute the KV mean covers, summed
over the ModelDeployment's pods. Only Prometheus keeps the history a rate needs, so the direct
scrape leaves them out and the policy then sizes on the queue and KV signals alone.

kvpilot-gateway holds demand the replicas have not seen: requests held while no replica is ready,
and, with flow control (`--max-in-flight-per-replica`), requests waiting in its fair queue while
the replicas are saturated. Both join the queue (`requests_waiting`). Under flow control the
runtime's received counter counts only what the gateway let through, which is capped at the rate
the replicas serve; the gateways count every request that reached their queue, so the arrival
rate the SLO sizing reads is the larger of the two (`arrivals_seen`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import requests
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.contract import metric_names
from kvpilot.operator.autoscaling import attainment, forecast
from kvpilot.operator.autoscaling.policy import RATE_WINDOW_S, Observations
from kvpilot.operator.planning.cost import Traffic

# The Prometheus labels kubernetes_sd relabelling makes of the pod labels the operator sets
# (manifests.LABEL_MODEL, inventory.LABEL_NODE_TYPE: labelmap of
# __meta_kubernetes_pod_label_kvpilot_dev_*, plus namespace and pod). The Prometheus config and
# the PodMonitor must produce exactly these.
PROM_LABEL_NAMESPACE = "namespace"
PROM_LABEL_POD = "pod"
PROM_LABEL_MODEL = "kvpilot_model"
PROM_LABEL_NODE_TYPE = "kvpilot_node_type"

# kvpilot's name first, then vLLM's alias as exported and as stored (metric_names.RuntimeMetric).
WAITING = metric_names.REQUESTS_WAITING.in_prometheus
RUNNING = metric_names.REQUESTS_RUNNING.in_prometheus
KV_USAGE = metric_names.KV_CACHE_USAGE.in_prometheus
TTFT = metric_names.TIME_TO_FIRST_TOKEN.in_prometheus
# Each request's time per output token (a histogram): a TPOT SLO's attainment.
TPOT = metric_names.REQUEST_TIME_PER_OUTPUT_TOKEN.in_prometheus
# Completed requests and generated tokens (counters, as Prometheus stores them): status.cost.
REQUEST_SUCCESS = metric_names.REQUEST_SUCCESS.in_prometheus
GENERATION_TOKENS = metric_names.GENERATION_TOKENS.in_prometheus
# Requests received (a counter): the arrival rate a TTFT SLO's forecast reads.
REQUEST_RECEIVED = metric_names.REQUEST_RECEIVED.in_prometheus
# kvpilot-gateway's demand for a ModelDeployment that no replica has seen: held while it has no
# replica to take them (scale from zero), queued while its replicas are saturated (flow control),
# and every request that reached the fair queue (a counter). The gateway labels them with the
# ModelDeployment, not with `namespace`: the scrape's relabelling sets `namespace`/`pod` to the
# gateway pod's own.
HELD = metric_names.GATEWAY_REQUESTS_HELD
QUEUED = metric_names.GATEWAY_REQUESTS_QUEUED
GATEWAY_ARRIVED = metric_names.GATEWAY_REQUESTS_ARRIVED
PROM_LABEL_MD_NAMESPACE = metric_names.GATEWAY_MD_NAMESPACE_LABEL
PROM_LABEL_MD_NAME = metric_names.GATEWAY_MD_NAME_LABEL

KV_AVERAGE = "1m"
# What a failed or unreachable Prometheus query raises through prometheus_api_client.
QUERY_ERRORS = (requests.RequestException, PrometheusApiClientException, ValueError)
TTFT_RATE = "2m"
DEFAULT_MAX_AGE_S = 60.0


@dataclass(frozen=True)
class RateWindows:
    """The ranges of the fleet's rates, in seconds: the forecaster's two windows and the minute
    the KV mean covers (a test shortens them so that they fill within seconds)."""

    short_s: int = int(forecast.SHORT_WINDOW_S)
    long_s: int = int(forecast.LONG_WINDOW_S)
    minute_s: int = int(RATE_WINDOW_S)


@dataclass(frozen=True)
class FleetRates:
    """Per-second rates and minute means summed over a ModelDeployment's pods, for a TTFT SLO's
    sizing; None where Prometheus has no series (a vLLM pod exports no arrivals counter). The
    gateway's arrivals are summed over the gateway replicas (None: no kvpilot-gateway routes to
    the ModelDeployment)."""

    arrivals_short_per_s: float | None = None
    arrivals_long_per_s: float | None = None
    completions_per_s: float | None = None
    tokens_per_s: float | None = None
    requests_running_1m: float | None = None
    gateway_arrivals_short_per_s: float | None = None
    gateway_arrivals_long_per_s: float | None = None


@dataclass(frozen=True)
class PodSample:
    pod: str
    node_type: str
    waiting: float
    running: float
    kv_cache_usage: float
    sampled_at: float  # unix seconds of the sample


# ---- pure: aggregation -----------------------------------------------------------------------


def aggregate(
    samples: Iterable[PodSample],
    current_replicas: int,
    now: float,
    ready_pods: Collection[str] | None = None,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    ttft_p95_s: float | None = None,
    requests_held: float = 0.0,
    rates: FleetRates = FleetRates(),
    slo_attainment: float | None = None,
    tpot_attainment: float | None = None,
    requests_queued: float = 0.0,
) -> Observations:
    """Observations from per-pod samples: only ready pods (when `ready_pods` is given) with
    samples at most `max_age_s` old count as capacity. `requests_held` and `requests_queued`
    (held, or in the fair queue, at gateways) join the queue: they are demand no replica has
    seen yet, held the only demand at zero replicas. The fleet's `rates` and the SLO's
    attainment go along only when there are fresh samples."""
    usable = [s for s in samples if ready_pods is None or s.pod in ready_pods]
    fresh = [s for s in usable if now - s.sampled_at <= max_age_s]
    unseen = requests_held + requests_queued
    if not fresh:
        if current_replicas == 0:
            # Nothing runs, so there is nothing to measure: an honest zero, not missing data.
            return Observations(
                current_replicas=0,
                requests_waiting=unseen,
                requests_held=requests_held,
                requests_queued=requests_queued,
                sampled_at=now,
                ttft_p95_s=ttft_p95_s,
            )
        if usable:  # only old samples: the policy reports them as stale
            newest = max(s.sampled_at for s in usable)
            return Observations(current_replicas=current_replicas, sampled_at=newest)
        return Observations.unavailable(current_replicas, "no samples from ready pods")
    return Observations(
        current_replicas=current_replicas,
        ready_replicas=len(fresh),
        requests_waiting=sum(s.waiting for s in fresh) + unseen,
        requests_held=requests_held,
        requests_queued=requests_queued,
        requests_running=sum(s.running for s in fresh),
        kv_cache_usage=sum(s.kv_cache_usage for s in fresh) / len(fresh),
        sampled_at=min(s.sampled_at for s in fresh),
        ttft_p95_s=ttft_p95_s,
        arrivals_short_per_s=arrivals_seen(
            rates.arrivals_short_per_s, rates.gateway_arrivals_short_per_s
        ),
        arrivals_long_per_s=arrivals_seen(
            rates.arrivals_long_per_s, rates.gateway_arrivals_long_per_s
        ),
        completions_per_s=rates.completions_per_s,
        tokens_per_s=rates.tokens_per_s,
        requests_running_1m=rates.requests_running_1m,
        ttft_slo_attainment=slo_attainment,
        tpot_slo_attainment=tpot_attainment,
    )


def arrivals_seen(runtime_per_s: float | None, gateway_per_s: float | None) -> float | None:
    """The arrival rate to size for: the larger of the replicas' received counter and the
    gateways' (None where neither has a series).

    Under flow control the replicas receive only what the gateway lets through, at most what
    they serve, so their rate cannot show a load beyond the fleet; the gateways count every
    request that reached their queue, those refused or timed out too. Traffic that bypasses the
    gateway (a client calling the Service) reaches only the replicas' counter, and a retry on
    another replica counts twice there: the larger never counts a request twice, and is exact
    whenever either path carries all the traffic. Not the queue's growth: the fair queue is
    bounded per tenant (a full one refuses), so it stops growing while the overload goes on,
    and the queue already sizes as a backlog to clear (`forecast`)."""
    found = [rate for rate in (runtime_per_s, gateway_per_s) if rate is not None]
    return max(found) if found else None


def aggregate_by_node_type(
    samples: Iterable[PodSample],
    current_per_type: Mapping[str, int],
    now: float,
    ready_pods: Collection[str] | None = None,
    max_age_s: float = DEFAULT_MAX_AGE_S,
) -> dict[str, Observations]:
    listed = list(samples)
    return {
        node_type: aggregate(
            [s for s in listed if s.node_type == node_type], current, now, ready_pods, max_age_s
        )
        for node_type, current in current_per_type.items()
    }


# ---- pure: PromQL ----------------------------------------------------------------------------


def selector(namespace: str, model: str, metric: str) -> str:
    labels = {"__name__": metric, PROM_LABEL_NAMESPACE: namespace, PROM_LABEL_MODEL: model}
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _per_pod(inner: str) -> str:
    return f"max by ({PROM_LABEL_POD}, {PROM_LABEL_NODE_TYPE}) ({inner})"


def gauge_query(names: tuple[str, ...], namespace: str, model: str, average: str = "") -> str:
    """One value per pod, from the first of `names` the pod exports."""
    parts = []
    for name in names:
        series = selector(namespace, model, name)
        parts.append(_per_pod(f"avg_over_time({series}[{average}])" if average else series))
    return " or ".join(parts)


def timestamp_query(namespace: str, model: str) -> str:
    """When each pod's queue gauge was last scraped (the age check)."""
    return " or ".join(
        _per_pod(f"timestamp({selector(namespace, model, name)})") for name in WAITING
    )


def ttft_p95_query(namespace: str, model: str) -> str:
    parts = [
        f"histogram_quantile(0.95, sum by (le) "
        f"(rate({selector(namespace, model, name + '_bucket')}[{TTFT_RATE}])))"
        for name in TTFT
    ]
    return " or ".join(parts)


def ttft_buckets_query(namespace: str, model: str, window_s: int = attainment.WINDOW_S) -> str:
    """The fleet's TTFT histogram over `window_s` as per-bucket rates (one sample per `le`)."""
    return buckets_query(TTFT, namespace, model, window_s)


def tpot_buckets_query(namespace: str, model: str, window_s: int = attainment.WINDOW_S) -> str:
    """The fleet's per-request TPOT histogram over `window_s`, as `ttft_buckets_query`."""
    return buckets_query(TPOT, namespace, model, window_s)


def buckets_query(names: tuple[str, ...], namespace: str, model: str, window_s: int) -> str:
    """Per-bucket rates of the first of `names` (histograms) the pods export."""
    window = prom_duration(window_s)
    return " or ".join(
        f"sum by (le) (rate({selector(namespace, model, name + '_bucket')}[{window}]))"
        for name in names
    )


def rate_query(names: tuple[str, ...], namespace: str, model: str, window: str) -> str:
    """Per node type, the per-second rate of the first of `names` the pods export, summed."""
    return " or ".join(
        f"sum by ({PROM_LABEL_NODE_TYPE}) (rate({selector(namespace, model, name)}[{window}]))"
        for name in names
    )


def fleet_query(
    names: tuple[str, ...], namespace: str, model: str, function: str, window: str
) -> str:
    """`function` ("rate" or "avg_over_time") over `window` of the first of `names` each pod
    exports, summed per pod (a counter has a series per label, e.g. finish reason) and then over
    the pods: a pod that exports both names counts once, a fleet mixing them counts every pod.
    One sample without labels; none when no pod has a series."""
    per_pod = " or ".join(
        f"sum by ({PROM_LABEL_POD}, {PROM_LABEL_NODE_TYPE}) "
        f"({function}({selector(namespace, model, name)}[{window}]))"
        for name in names
    )
    return f"sum({per_pod})"


def fleet_queries(
    namespace: str, model: str, windows: RateWindows = RateWindows()
) -> dict[str, str]:
    """The PromQL of each FleetRates field."""
    short, long = prom_duration(windows.short_s), prom_duration(windows.long_s)
    minute = prom_duration(windows.minute_s)
    return {
        "arrivals_short_per_s": fleet_query(REQUEST_RECEIVED, namespace, model, "rate", short),
        "arrivals_long_per_s": fleet_query(REQUEST_RECEIVED, namespace, model, "rate", long),
        "completions_per_s": fleet_query(REQUEST_SUCCESS, namespace, model, "rate", minute),
        "tokens_per_s": fleet_query(GENERATION_TOKENS, namespace, model, "rate", minute),
        "requests_running_1m": fleet_query(RUNNING, namespace, model, "avg_over_time", minute),
        "gateway_arrivals_short_per_s": gateway_arrivals_query(namespace, model, short),
        "gateway_arrivals_long_per_s": gateway_arrivals_query(namespace, model, long),
    }


def scalar(vector: list[dict[str, Any]]) -> float | None:
    """The value of a one-sample instant vector; None when it is empty or not a finite number
    (a rate over a window with fewer than two scrapes has no sample)."""
    values = [float(item["value"][1]) for item in vector]
    finite = [v for v in values if math.isfinite(v)]
    return finite[0] if finite else None


def prom_duration(seconds: int) -> str:
    """A PromQL range: 300 -> "5m", 90 -> "90s"."""
    return f"{seconds // 60}m" if seconds % 60 == 0 else f"{seconds}s"


def held_query(namespace: str, model: str) -> str:
    """Requests every gateway replica holds for this ModelDeployment, summed (no series: none)."""
    return f"sum({gateway_selector(HELD, namespace, model)})"


def queued_query(namespace: str, model: str) -> str:
    """Requests in every gateway replica's fair queue for this ModelDeployment, summed."""
    return f"sum({gateway_selector(QUEUED, namespace, model)})"


def gateway_arrivals_query(namespace: str, model: str, window: str) -> str:
    """Requests per second reaching every gateway replica's fair queue for this ModelDeployment
    (adapters' names included), summed; no sample when no gateway has the series."""
    return f"sum(rate({gateway_selector(GATEWAY_ARRIVED, namespace, model)}[{window}]))"


def gateway_selector(metric: str, namespace: str, model: str) -> str:
    """A gateway series of the ModelDeployment `namespace`/`model`, by its md_* labels."""
    labels = {"__name__": metric, PROM_LABEL_MD_NAMESPACE: namespace, PROM_LABEL_MD_NAME: model}
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def samples_from_vectors(
    waiting: list[dict[str, Any]],
    running: list[dict[str, Any]],
    kv: list[dict[str, Any]],
    stamps: list[dict[str, Any]],
) -> list[PodSample]:
    """Join Prometheus instant vectors (one element per pod) into per-pod samples."""

    def by_pod(vector: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
        return {_key(item["metric"]): float(item["value"][1]) for item in vector}

    waiting_by, running_by, kv_by = by_pod(waiting), by_pod(running), by_pod(kv)
    samples = []
    for key, stamp in by_pod(stamps).items():
        if key not in waiting_by:
            continue
        samples.append(
            PodSample(
                pod=key[0],
                node_type=key[1],
                waiting=waiting_by[key],
                running=running_by.get(key, 0.0),
                kv_cache_usage=kv_by.get(key, 0.0),
                sampled_at=stamp,
            )
        )
    return samples


def _key(labels: Mapping[str, str]) -> tuple[str, str]:
    return labels.get(PROM_LABEL_POD, ""), labels.get(PROM_LABEL_NODE_TYPE, "")


# ---- adapter: Prometheus ---------------------------------------------------------------------


class PrometheusMetrics:
    """Reads per-pod samples for a ModelDeployment from Prometheus."""

    def __init__(
        self, url: str, timeout_s: float = 5.0, windows: RateWindows = RateWindows()
    ) -> None:
        self.client = PrometheusConnect(url=url, disable_ssl=True, timeout=timeout_s)
        self.windows = windows

    def _query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """`promql` evaluated at `at` (unix seconds), or at Prometheus' now."""
        params = None if at is None else {"time": f"{at:.3f}"}
        result = self.client.custom_query(query=promql, params=params)
        return list(result or [])

    def pod_samples(self, namespace: str, model: str) -> list[PodSample]:
        return samples_from_vectors(
            self._query(gauge_query(WAITING, namespace, model)),
            self._query(gauge_query(RUNNING, namespace, model)),
            self._query(gauge_query(KV_USAGE, namespace, model, average=KV_AVERAGE)),
            self._query(timestamp_query(namespace, model)),
        )

    def requests_held(self, namespace: str, model: str) -> float:
        vector = self._query(held_query(namespace, model))
        return sum(float(item["value"][1]) for item in vector)

    def requests_queued(self, namespace: str, model: str) -> float:
        vector = self._query(queued_query(namespace, model))
        return sum(float(item["value"][1]) for item in vector)

    def fleet_rates(self, namespace: str, model: str) -> FleetRates:
        """The rates at one evaluation instant: a scrape landing between two of the queries
        would otherwise make tokens per completion (and arrivals against completions) wrong."""
        queries, at = fleet_queries(namespace, model, self.windows), time.time()
        return FleetRates(**{field: scalar(self._query(q, at)) for field, q in queries.items()})

    def ttft_p95(self, namespace: str, model: str) -> float | None:
        return scalar(self._query(ttft_p95_query(namespace, model)))

    def traffic(self, namespace: str, model: str, window: str) -> dict[str, Traffic]:
        """Completed requests and output tokens per second per node type over `window`."""
        requests_by = self._by_node_type(rate_query(REQUEST_SUCCESS, namespace, model, window))
        tokens_by = self._by_node_type(rate_query(GENERATION_TOKENS, namespace, model, window))
        return {
            node_type: Traffic(requests_by.get(node_type, 0.0), tokens_by.get(node_type, 0.0))
            for node_type in requests_by.keys() | tokens_by.keys()
        }

    def _by_node_type(self, promql: str) -> dict[str, float]:
        vector = self._query(promql)
        return {
            item["metric"].get(PROM_LABEL_NODE_TYPE, ""): float(item["value"][1]) for item in vector
        }

    def observe(
        self,
        namespace: str,
        model: str,
        current_replicas: int,
        ready_pods: Collection[str] | None = None,
        now: float | None = None,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
    ) -> Observations:
        """Observations for the policy; an unreachable or failing Prometheus yields
        unavailable observations (the policy then holds), never an exception. The fleet's
        rates (five range queries) and the attainment of the TTFT target are read for a
        ModelDeployment with an SLO (`slo_ttft_s`) only, and the TPOT target's with one
        (`slo_tpot_s`): nothing else sizes on them, so a fleet without one does not pay for
        them each tick."""
        try:
            samples = self.pod_samples(namespace, model)
            ttft = self.ttft_p95(namespace, model)
            held = self.requests_held(namespace, model)
            queued = self.requests_queued(namespace, model)
            rates, met, tpot_met = FleetRates(), None, None
            if slo_ttft_s is not None:
                rates = self.fleet_rates(namespace, model)
                met = self.ttft_attainment(namespace, model, slo_ttft_s)
            if slo_tpot_s is not None:
                tpot_met = self.tpot_attainment(namespace, model, slo_tpot_s)
        except QUERY_ERRORS as exc:
            return Observations.unavailable(current_replicas, f"prometheus: {_brief(exc)}")
        now = time.time() if now is None else now
        share = None if met is None else met.share
        tpot_share = None if tpot_met is None else tpot_met.share
        return aggregate(samples, current_replicas, now, ready_pods, max_age_s, ttft, held,
                         rates, share, tpot_share, queued)  # fmt: skip

    def ttft_attainment(
        self, namespace: str, model: str, target_s: float
    ) -> attainment.Attainment | None:
        """The share of requests over the last window whose TTFT met `target_s`."""
        vector = self._query(ttft_buckets_query(namespace, model))
        return attainment.from_buckets(attainment.buckets_from_vector(vector), target_s)

    def tpot_attainment(
        self, namespace: str, model: str, target_s: float
    ) -> attainment.Attainment | None:
        """The share of requests over the last window whose time per output token met
        `target_s` (requests of one token have none and are not counted)."""
        vector = self._query(tpot_buckets_query(namespace, model))
        return attainment.from_buckets(attainment.buckets_from_vector(vector), target_s)


def _brief(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc)[:160]}"


# ---- adapter: scraping the pods directly -----------------------------------------------------


def parse_exposition(text: str) -> dict[str, float]:
    """The three gauges from one pod's /metrics text, under kvpilot's names."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for signal in (WAITING, RUNNING, KV_USAGE):
            if family.name not in signal or not family.samples:
                continue
            found = [sample.value for sample in family.samples]
            value = max(found) if signal is KV_USAGE else sum(found)
            # kvpilot's own name wins over the alias when a pod exports both
            if signal[0] not in values or family.name == signal[0]:
                values[signal[0]] = value
    return values


async def scrape_pods(
    urls: Mapping[str, str],
    node_types: Mapping[str, str],
    timeout_s: float = 2.0,
) -> list[PodSample]:
    """Scrape every pod's /metrics URL at once; pods that fail or time out are left out."""
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        pods = list(urls)
        texts = await asyncio.gather(
            *(_fetch(client, urls[pod]) for pod in pods), return_exceptions=True
        )
    samples = []
    for pod, text in zip(pods, texts, strict=True):
        if not isinstance(text, str):
            continue
        try:
            values = parse_exposition(text)
        except ValueError:
            continue
        if WAITING[0] not in values:
            continue
        samples.append(
            PodSample(
                pod=pod,
                node_type=node_types.get(pod, ""),
                waiting=values[WAITING[0]],
                running=values.get(RUNNING[0], 0.0),
                kv_cache_usage=values.get(KV_USAGE[0], 0.0),
                sampled_at=time.time(),
            )
        )
    return samples


async def _fetch(client: httpx.AsyncClient, url: str) -> str:
    response = await client.get(url)
    response.raise_for_status()
    return response.text


async def observe_pods(
    urls: Mapping[str, str],
    node_types: Mapping[str, str],
    current_replicas: int,
    timeout_s: float = 2.0,
) -> Observations:
    """Observations from the ready pods' own /metrics (no Prometheus configured): `urls` maps
    each ready pod's name to its metrics URL."""
    samples = await scrape_pods(urls, node_types, timeout_s)
    if urls and not samples:
        return Observations.unavailable(current_replicas, f"none of {len(urls)} pods answered")
    return aggregate(samples, current_replicas, time.time())
