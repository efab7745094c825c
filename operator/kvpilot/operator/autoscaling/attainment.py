"""SLO attainment: the share of requests whose time to first token met the target (pure).

The runtime's TTFT histogram (`vllm:time_to_first_token_seconds`, vLLM's buckets) gives per
bucket the rate of requests at or under each bound `le`, cumulative, with +Inf the total. A
target between two bounds is placed by linear interpolation inside its bucket, the assumption
PromQL's histogram_quantile makes, so attainment and the p95 in status agree with each other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The window attainment is measured over: long enough to hold hundreds of requests at a few per
# second, short enough that status says how the SLO holds now rather than over the day.
WINDOW_S = 300


@dataclass(frozen=True)
class Attainment:
    """The share (0-1) of requests inside the target and how many per second it counts."""

    share: float
    requests_per_s: float


def from_buckets(cumulative: Mapping[float, float], target_s: float) -> Attainment | None:
    """Attainment of `target_s` from cumulative bucket rates keyed by their upper bound (math.inf
    for +Inf); None without requests or without a +Inf bucket (the total)."""
    total = cumulative.get(math.inf)
    if total is None or not math.isfinite(total) or total <= 0:
        return None
    lower_bound, lower_count = 0.0, 0.0
    for bound in sorted(cumulative):
        count = cumulative[bound]
        if target_s < bound:
            if math.isinf(bound):  # beyond the last finite bound: every counted one is under
                return Attainment(lower_count / total, total)
            inside = (target_s - lower_bound) / (bound - lower_bound)
            return Attainment(_clamp((lower_count + inside * (count - lower_count)) / total), total)
        lower_bound, lower_count = bound, count
    return Attainment(_clamp(lower_count / total), total)


def buckets_from_vector(vector: list[dict[str, Any]]) -> dict[float, float]:
    """{upper bound: rate} from a Prometheus instant vector summed by `le`; NaN rates (a window
    without two scrapes) left out."""
    buckets: dict[float, float] = {}
    for item in vector:
        le, value = item["metric"].get("le"), float(item["value"][1])
        if le is not None and math.isfinite(value):
            buckets[float(le)] = value  # float("+Inf") is math.inf
    return buckets


def _clamp(share: float) -> float:
    return min(1.0, max(0.0, share))
