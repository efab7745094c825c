"""Each adapter's demand, for the placement (adapters/assignment.py): its requests per second
over the last `WINDOW_S` from Prometheus when the operator has one, as the autoscaler reads its
signals (a recent rate: a shift in demand shows within the window), else None and the adapter
sync uses the pods' own counters since they started, which it reads anyway (the shares since
then). Either way the runtime's `kvpilot_lora_requests_received_total{lora_name}`
(metric_names.LORA_REQUESTS_RECEIVED), summed over the ModelDeployment's pods.

`demand_query` and `from_vector` are pure; `PrometheusDemand` is the thin reader.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_api_client import PrometheusConnect

from kvpilot.contract import metric_names
from kvpilot.operator.autoscaling.metrics_reader import QUERY_ERRORS, prom_duration, selector

WINDOW_S = 600  # ten minutes: long enough that one burst does not move adapters
log = logging.getLogger(__name__)


def demand_query(namespace: str, model: str, window_s: int = WINDOW_S) -> str:
    """Requests per second per adapter over `window_s`, summed over the pods."""
    series = selector(namespace, model, metric_names.LORA_REQUESTS_RECEIVED)
    label = metric_names.LORA_NAME_LABEL
    return f"sum by ({label}) (rate({series}[{prom_duration(window_s)}]))"


def from_vector(vector: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """adapter -> requests per second, from the query's instant vector (non-finite left out)."""
    rates = {}
    for item in vector:
        value = float(item["value"][1])
        if math.isfinite(value):
            rates[item["metric"].get(metric_names.LORA_NAME_LABEL, "")] = value
    return rates


class PrometheusDemand:
    """Reads each adapter's request rate of a ModelDeployment from Prometheus."""

    def __init__(self, url: str, timeout_s: float = 5.0, window_s: int = WINDOW_S) -> None:
        self.client = PrometheusConnect(url=url, disable_ssl=True, timeout=timeout_s)
        self.window_s = window_s

    def read(self, namespace: str, model: str) -> dict[str, float] | None:
        """The rates; None when Prometheus fails or has seen no request to any adapter in the
        window (the sync then plans from the pods' counters)."""
        try:
            vector = self.client.custom_query(query=demand_query(namespace, model, self.window_s))
        except QUERY_ERRORS as error:
            log.info("adapter demand of %s/%s from Prometheus: %s", namespace, model, error)
            return None
        rates = from_vector(vector or [])
        return rates if sum(rates.values()) > 0 else None
