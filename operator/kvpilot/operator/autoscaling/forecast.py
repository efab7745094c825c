"""Demand ahead of a cold start, from the arrival rate's trend and the queue (issue 33 item 3).

A replica asked for now serves only after its cold start, so the fleet must be sized for the load
one cold start (plus a decision interval) ahead. The arrival rate is read over two nested windows,
as two Prometheus `rate()` queries would give it: a short one that follows a burst within seconds
and a long one that remembers the recent past.

- Steady: the long window's rate, which Poisson noise moves least (a short window's noise would
  make a fleet at the edge of two sizes flap).
- Fast up: when the short window's rate is above the long one's by more than Poisson noise
  would put it (`SIGNIFICANCE` standard deviations), the short rate plus the trend (short minus
  long, over the distance between the windows' centres) extrapolated over the lead time.
  Extrapolation is capped at `max_growth` x the short rate, so one step cannot ask for the whole
  cluster.
- Down: a falling rate is never extrapolated. A fall within Poisson noise keeps the long
  window's rate (the fleet for the recent past); a fall beyond it (`SIGNIFICANCE` standard
  deviations, as for a rise) provisions for the short window's rate, since the load has left:
  the long window would hold a spike's fleet for up to two minutes after the spike
  (bench.autoscaler_sim, spikes and flash crowd). The policy also shortens its down window then.
- The queue: requests already waiting are a backlog to clear within one lead time, on top of
  what keeps arriving (waiting grows whenever arrivals exceed service, so a growing queue raises
  the demand by itself).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The windows the metrics adapter reads arrival rates over (Prometheus rate() ranges).
SHORT_WINDOW_S = 30.0
LONG_WINDOW_S = 120.0
# Standard deviations of Poisson noise a rise must exceed to be extrapolated. The test runs every
# 10 s tick on 30 s windows: at 2 (one-sided 2.3%) steady load crossed it a few times an hour
# and each crossing asked for a rise that was not there (bench.autoscaler_sim, steady trace). A
# step or spike of +5/s on 4/s is past 3.5 within 10-20 s of its start.
SIGNIFICANCE = 3.5


@dataclass(frozen=True)
class ArrivalRates:
    """Arrivals per second over two nested windows ending now (the short inside the long)."""

    short_per_s: float
    long_per_s: float
    short_window_s: float = SHORT_WINDOW_S
    long_window_s: float = LONG_WINDOW_S

    def __post_init__(self) -> None:
        if self.short_per_s < 0 or self.long_per_s < 0:
            raise ValueError("arrival rates must be >= 0")
        if not 0 < self.short_window_s < self.long_window_s:
            raise ValueError("need 0 < short window < long window")


@dataclass(frozen=True)
class Forecast:
    arrivals_per_s: float  # the arrival rate to provision for
    backlog_per_s: float  # extra service rate that clears the queue within the lead time
    trend_per_s2: float  # the significant trend, 0 when it is noise or falling
    reason: str
    falling: bool = False  # the short window's rate is below the long one's beyond noise

    @property
    def demand_per_s(self) -> float:
        return self.arrivals_per_s + self.backlog_per_s


def forecast(
    rates: ArrivalRates,
    waiting: float,
    lead_s: float,
    significance: float = SIGNIFICANCE,
    max_growth: float = 2.0,
) -> Forecast:
    """Requests per second the fleet must serve once capacity asked for now is ready.

    `lead_s` is the measured cold start plus one decision interval; `significance` is how many
    standard deviations of Poisson noise a rising trend must exceed to be extrapolated."""
    if lead_s < 0 or waiting < 0:
        raise ValueError("lead time and waiting must be >= 0")
    trend = significant_trend(rates, significance)
    falling = trend == 0 and significant_fall(rates, significance)
    if trend > 0:
        seen = rates.short_per_s
        ahead = min(seen + trend * lead_s, seen * max_growth)
    elif falling:
        ahead = rates.short_per_s
    else:
        ahead = rates.long_per_s
    backlog = waiting / max(lead_s, 1.0)
    reason = (
        f"arrivals {rates.short_per_s:.2f}/s ({rates.short_window_s:.0f}s), "
        f"{rates.long_per_s:.2f}/s ({rates.long_window_s:.0f}s)"
    )
    if trend > 0:
        reason += f", rising {trend:.3f}/s2 -> {ahead:.2f}/s in {lead_s:.0f}s"
    if falling:
        reason += ", falling"
    if waiting > 0:
        reason += f", {waiting:g} waiting"
    return Forecast(ahead, backlog, trend, reason, falling)


def significant_trend(rates: ArrivalRates, significance: float) -> float:
    """The rising trend in requests/s per second, or 0 when falling or within Poisson noise
    (`_noise_sd`)."""
    rise = rates.short_per_s - rates.long_per_s
    if rise <= significance * _noise_sd(rates):
        return 0.0
    centres_apart_s = (rates.long_window_s - rates.short_window_s) / 2
    return rise / centres_apart_s


def significant_fall(rates: ArrivalRates, significance: float) -> bool:
    """Whether the short window's rate is below the long one's by more than `significance`
    standard deviations of Poisson noise: the load has left, not a quiet half-minute."""
    return rates.long_per_s - rates.short_per_s > significance * _noise_sd(rates)


def _noise_sd(rates: ArrivalRates) -> float:
    """The standard deviation of short minus long under a steady Poisson load at the long
    window's rate: for nested windows the shared arrivals cancel, leaving rate x (1/short -
    1/long)."""
    return math.sqrt(rates.long_per_s * (1 / rates.short_window_s - 1 / rates.long_window_s))
