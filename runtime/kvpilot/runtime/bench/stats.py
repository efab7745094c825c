"""Serving metrics from per-request timings, defined as vLLM's `benchmark_serving` defines them.

- TTFT: request sent -> first chunk carrying text.
- ITL: gaps between consecutive text chunks (all requests pooled).
- TPOT: (e2e - TTFT) / (output_tokens - 1), only for requests with more than one output token;
  for goodput a one-token request counts TPOT 0.
- E2EL: request sent -> last byte.
- Throughputs divide by the benchmark's wall-clock duration; goodput counts only requests that
  meet every given SLO (milliseconds, `metric <= slo`).
Percentiles use numpy's default (linear) interpolation, as vLLM does, so figures are comparable.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    success: bool
    start: float  # seconds since the benchmark started
    prompt_len: int = 0
    output_len: int = 0  # tokens, from the server's usage when it reports it
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""

    def tpot(self) -> float | None:
        if not self.success or self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    def chunk_times(self) -> list[float]:
        """Arrival time of each text chunk, seconds since the benchmark started."""
        times = [self.start + self.ttft]
        for gap in self.itl:
            times.append(times[-1] + gap)
        return times


@dataclass(frozen=True)
class Distribution:
    """One latency metric in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[str, float]  # "p95" -> ms

    @classmethod
    def of(cls, seconds: list[float], percentiles: tuple[float, ...]) -> Distribution:
        values = np.asarray(seconds or [0.0], dtype=float) * 1000.0
        pcts = {_pct_key(p): float(np.percentile(values, p)) for p in percentiles}
        return cls(float(values.mean()), float(np.median(values)), float(values.std()), pcts)


@dataclass(frozen=True)
class Summary:
    duration_s: float
    num_requests: int
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    request_goodput: float | None  # req/s meeting all SLOs; None without SLOs
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (input + output) tok/s
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    cost_per_1k_requests: float | None  # same currency as the GPU-hour price
    errors: dict[str, int]

    def to_dict(self) -> dict:
        return asdict(self)


def _pct_key(p: float) -> str:
    return f"p{p:g}"


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ValueError(f"percentiles must be comma-separated numbers, got {text!r}") from exc
    if not values or any(not 0 <= v <= 100 for v in values):
        raise ValueError(f"percentiles must be in [0, 100], got {text!r}")
    return values


def parse_slos(items: list[str]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO must be one of {SLO_METRICS} as NAME:MS, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError as exc:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number") from exc
        if not slos[name] > 0 or math.isinf(slos[name]):
            raise ValueError(f"goodput SLO {item!r} must be a positive number of milliseconds")
    return slos


def is_good(result: RequestResult, slos: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft, "tpot": result.tpot() or 0.0, "e2el": result.latency}
    return all(measured[name] <= ms / 1000.0 for name, ms in slos.items())


def cost_per_1k_requests(
    price_per_gpu_hour: float, num_gpus: int, duration_s: float, completed: int
) -> float | None:
    """What 1,000 requests cost at the measured rate, GPUs billed for the whole run."""
    if completed == 0:
        return None
    return price_per_gpu_hour * num_gpus * (duration_s / 3600.0) / completed * 1000.0


def summarize(
    results: list[RequestResult],
    duration_s: float,
    *,
    percentiles: tuple[float, ...] = (50.0, 95.0, 99.0),
    slos: dict[str, float] | None = None,
    price_per_gpu_hour: float | None = None,
    num_gpus: int = 1,
) -> Summary:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [t for r in ok if (t := r.tpot()) is not None]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    good = sum(is_good(r, slos) for r in ok) if slos else None
    cost = None
    if price_per_gpu_hour is not None:
        cost = cost_per_1k_requests(price_per_gpu_hour, num_gpus, duration_s, len(ok))
    return Summary(
        duration_s=duration_s,
        num_requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        request_goodput=None if good is None else good / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft_ms=Distribution.of([r.ttft for r in ok], percentiles),
        tpot_ms=Distribution.of(tpots, percentiles),
        itl_ms=Distribution.of([gap for r in ok for gap in r.itl], percentiles),
        e2el_ms=Distribution.of([r.latency for r in ok], percentiles),
        cost_per_1k_requests=cost,
        errors=errors,
    )


def throughput_timeline(results: list[RequestResult], bin_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive bins of `bin_s` from the benchmark's start.

    A chunk may carry several tokens, so each request's tokens are spread evenly over its chunks.
    """
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    ok = [r for r in results if r.success and r.output_len > 0]
    if not ok:
        return []
    end = max(r.chunk_times()[-1] for r in ok)
    bins = np.zeros(int(end // bin_s) + 1)
    for r in ok:
        times = r.chunk_times()
        for t in times:
            bins[int(t // bin_s)] += r.output_len / len(times)
    return [float(v / bin_s) for v in bins]
