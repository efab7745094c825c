"""Request traces: who arrives when, with how many prompt and output tokens.

Synthetic traces are non-homogeneous Poisson processes: a rate per second (req/s) drawn as Poisson
counts, each arrival placed uniformly inside its second, sizes from log-normal distributions. A
seed makes them exactly reproducible. A JSONL file replays a recorded trace, one request a line:
`{"arrival_s": 12.5, "prompt_tokens": 700, "output_tokens": 250}` (`t` is accepted for
`arrival_s`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
RateFn = Callable[[FloatArray], FloatArray]

MEAN_PROMPT_TOKENS = 800.0
MEAN_OUTPUT_TOKENS = 400.0


@dataclass(frozen=True, eq=False)
class Trace:
    name: str
    duration_s: float
    arrival_s: FloatArray  # sorted
    prompt_tokens: IntArray
    output_tokens: IntArray

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.prompt_tokens) != n or len(self.output_tokens) != n:
            raise ValueError(f"trace {self.name}: arrival and size arrays differ in length")
        if n and (np.any(np.diff(self.arrival_s) < 0) or self.arrival_s[0] < 0):
            raise ValueError(f"trace {self.name}: arrivals must be sorted and >= 0")
        if self.duration_s <= 0:
            raise ValueError(f"trace {self.name}: duration must be > 0")

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)

    def mean_tokens(self) -> float:
        if not self.num_requests:
            return MEAN_PROMPT_TOKENS + MEAN_OUTPUT_TOKENS
        return float(np.mean(self.prompt_tokens + self.output_tokens))

    def rate_per_s(self, bin_s: float) -> tuple[FloatArray, FloatArray]:
        """(bin start times, arrivals per second in each bin), for plots."""
        edges = np.arange(0.0, self.duration_s + bin_s, bin_s)
        counts, _ = np.histogram(self.arrival_s, bins=edges)
        return edges[:-1], counts / bin_s


def from_rate(name: str, rate: RateFn, duration_s: float, seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    seconds = np.arange(math.ceil(duration_s), dtype=np.float64)
    counts = rng.poisson(np.maximum(rate(seconds), 0.0))
    arrivals = np.repeat(seconds, counts) + rng.random(int(counts.sum()))
    arrivals = np.sort(arrivals[arrivals < duration_s])
    prompt = _lognormal(rng, MEAN_PROMPT_TOKENS, 0.6, len(arrivals), (16, 4096))
    output = _lognormal(rng, MEAN_OUTPUT_TOKENS, 0.5, len(arrivals), (8, 2048))
    return Trace(name, duration_s, arrivals, prompt, output)


def _lognormal(
    rng: np.random.Generator, mean: float, sigma: float, n: int, clip: tuple[int, int]
) -> IntArray:
    mu = math.log(mean) - sigma**2 / 2  # so that the mean of the distribution is `mean`
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), *clip).astype(np.int64)


def step_burst(
    duration_s: float = 3600.0, base: float = 4.0, peak: float = 14.0, seed: int = 0
) -> Trace:
    """base req/s, then peak req/s for the middle third, then base again: a sharp step."""
    start, end = duration_s / 3, 2 * duration_s / 3
    return from_rate(
        "burst",
        lambda t: np.where((t >= start) & (t < end), peak, base),
        duration_s,
        seed,
    )


def diurnal(
    duration_s: float = 86_400.0, low: float = 1.5, high: float = 12.0, seed: int = 0
) -> Trace:
    """A day: a sine from `low` at midnight to `high` at noon."""
    mid, amp = (high + low) / 2, (high - low) / 2
    return from_rate(
        "diurnal",
        lambda t: mid - amp * np.cos(2 * np.pi * t / 86_400.0),
        duration_s,
        seed,
    )


def steady(duration_s: float = 7200.0, rate: float = 6.0, seed: int = 0) -> Trace:
    return from_rate("steady", lambda t: np.full_like(t, rate), duration_s, seed)


def poisson_spikes(
    duration_s: float = 7200.0,
    base: float = 4.0,
    spikes_per_hour: float = 4.0,
    seed: int = 0,
) -> Trace:
    """base req/s plus spikes at Poisson times, each +5..+10 req/s for 1..4 minutes."""
    rng = np.random.default_rng(seed + 1_000_003)
    num = rng.poisson(spikes_per_hour * duration_s / 3600.0)
    starts = rng.uniform(0, duration_s, num)
    lengths = rng.uniform(60, 240, num)
    heights = rng.uniform(5, 10, num)

    def rate(t: FloatArray) -> FloatArray:
        extra = np.zeros_like(t)
        for start, length, height in zip(starts, lengths, heights, strict=True):
            extra += np.where((t >= start) & (t < start + length), height, 0.0)
        return base + extra

    return from_rate("spikes", rate, duration_s, seed)


def flash_crowd(
    duration_s: float = 3600.0,
    base: float = 1.4,
    peak: float = 14.0,
    ramp_s: float = 30.0,
    hold_s: float = 600.0,
    seed: int = 0,
) -> Trace:
    """A flash crowd: base req/s, then 10x within `ramp_s` (linear), held for `hold_s`, then
    back down over `ramp_s`; it starts a third of the way in."""
    start = duration_s / 3
    fall = start + ramp_s + hold_s

    def rate(t: FloatArray) -> FloatArray:
        rising = np.clip((t - start) / ramp_s, 0.0, 1.0)
        falling = np.clip((t - fall) / ramp_s, 0.0, 1.0)
        return base + (peak - base) * (rising - falling)

    return from_rate("flash", rate, duration_s, seed)


def replay_jsonl(path: Path, duration_s: float | None = None) -> Trace:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            at = float(row["arrival_s"] if "arrival_s" in row else row["t"])
            rows.append((at, int(row["prompt_tokens"]), int(row["output_tokens"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: bad request line ({exc}): {line[:80]}") from exc
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort()
    arrival = np.array([row[0] for row in rows], dtype=np.float64)
    prompt = np.array([row[1] for row in rows], dtype=np.int64)
    output = np.array([row[2] for row in rows], dtype=np.int64)
    end = duration_s if duration_s is not None else math.ceil(float(arrival[-1]) + 1)
    keep = arrival < end
    return Trace(
        path.stem,
        float(end),
        arrival[keep].astype(np.float64),
        np.maximum(prompt[keep], 1).astype(np.int64),
        np.maximum(output[keep], 1).astype(np.int64),
    )


def write_jsonl(trace: Trace, path: Path) -> None:
    columns = (trace.arrival_s.tolist(), trace.prompt_tokens.tolist(), trace.output_tokens.tolist())
    lines = [
        json.dumps({"arrival_s": round(a, 6), "prompt_tokens": p, "output_tokens": o})
        for a, p, o in zip(*columns, strict=True)
    ]
    path.write_text("\n".join(lines) + "\n")


BUILTIN: dict[str, Callable[..., Trace]] = {
    "burst": step_burst,
    "diurnal": diurnal,
    "spikes": poisson_spikes,
    "steady": steady,
    "flash": flash_crowd,
}


def build(spec: str, seed: int, duration_s: float | None = None) -> Trace:
    """A trace by name (burst, diurnal, spikes, steady, flash) or from a JSONL file path."""
    if spec in BUILTIN:
        make = BUILTIN[spec]
        return make(seed=seed) if duration_s is None else make(duration_s=duration_s, seed=seed)
    path = Path(spec)
    if path.suffix == ".jsonl" or path.exists():
        return replay_jsonl(path, duration_s)
    raise ValueError(f"unknown trace {spec!r}: use one of {sorted(BUILTIN)} or a .jsonl file")
