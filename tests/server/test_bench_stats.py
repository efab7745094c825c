"""kvpilot bench statistics against values computed by hand (vLLM benchmark_serving definitions)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from kvpilot.runtime.bench.stats import (
    RequestResult,
    cost_per_1k_requests,
    parse_percentiles,
    parse_slos,
    summarize,
    throughput_timeline,
)
from kvpilot.runtime.bench.workload import arrival_times, synthetic_lengths


def req(ttft: float, itl: list[float], out: int, start: float = 0.0, prompt: int = 10):
    return RequestResult(
        success=True,
        start=start,
        prompt_len=prompt,
        output_len=out,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
    )


# Three requests: A 5 tokens, B 3 tokens, C 1 token; plus one failure that must not count.
A = req(0.100, [0.02, 0.02, 0.03, 0.03], 5)  # e2e .200, tpot (.2-.1)/4 = .025
B = req(0.200, [0.05, 0.05], 3, start=0.5)  # e2e .300, tpot (.3-.2)/2 = .050
C = req(0.300, [], 1, start=1.0)  # e2e .300, no tpot (one token); goodput treats it as 0
FAILED = RequestResult(success=False, start=0.2, error="HTTP 429: busy")
RESULTS = [A, B, C, FAILED]


def test_summary_matches_hand_computed_values() -> None:
    s = summarize(RESULTS, duration_s=2.0, percentiles=(50, 100))
    assert (s.completed, s.failed, s.num_requests) == (3, 1, 4)
    assert s.total_input_tokens == 30 and s.total_output_tokens == 9
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(4.5)
    assert s.total_token_throughput == pytest.approx(19.5)
    assert s.ttft_ms.mean == pytest.approx(200.0)
    assert s.ttft_ms.median == pytest.approx(200.0)
    assert s.ttft_ms.std == pytest.approx(math.sqrt((100**2 + 0 + 100**2) / 3))
    assert s.tpot_ms.mean == pytest.approx(37.5)  # C has no TPOT
    assert s.e2el_ms.percentiles["p100"] == pytest.approx(300.0)
    # ITL pools all gaps: 20, 20, 30, 30, 50, 50 ms
    assert s.itl_ms.mean == pytest.approx(200 / 6)
    assert s.itl_ms.percentiles["p50"] == pytest.approx(30.0)
    assert s.errors == {"HTTP 429: busy": 1}
    assert s.request_goodput is None and s.cost_per_1k_requests is None


def test_percentiles_interpolate_linearly_like_numpy() -> None:
    results = [req(t / 1000, [], 1) for t in (10, 20, 30, 40)]
    s = summarize(results, duration_s=1.0, percentiles=(95, 99))
    # rank 0.95 * 3 = 2.85 -> 30 + 0.85 * 10
    assert s.ttft_ms.percentiles["p95"] == pytest.approx(38.5)
    assert s.ttft_ms.percentiles["p99"] == pytest.approx(39.7)


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 150}, 1),  # only A
        ({"ttft": 250}, 2),
        ({"tpot": 30}, 2),  # A (25 ms) and C (counts 0)
        ({"e2el": 250}, 1),
        ({"ttft": 1000, "tpot": 60, "e2el": 1000}, 3),
        ({"ttft": 250, "tpot": 30}, 1),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slos: dict[str, float], good: int) -> None:
    assert summarize(RESULTS, duration_s=2.0, slos=slos).request_goodput == pytest.approx(good / 2)


def test_cost_per_thousand_requests() -> None:
    # 2 GPUs at $3/h for 36 s = $0.06 for 120 requests -> $0.50 per 1,000
    assert cost_per_1k_requests(3.0, 2, 36.0, 120) == pytest.approx(0.5)
    assert cost_per_1k_requests(3.0, 1, 36.0, 0) is None
    s = summarize(RESULTS, duration_s=2.0, price_per_gpu_hour=3.6)
    assert s.cost_per_1k_requests == pytest.approx(3.6 * 2 / 3600 / 3 * 1000)


def test_throughput_timeline_spreads_tokens_over_chunks() -> None:
    # A: chunks at .10 .12 .14 .17 .20 (5 tokens); B: .7 .75 .8 (3); C: 1.3 (1)
    assert throughput_timeline(RESULTS, bin_s=1.0) == pytest.approx([8.0, 1.0])
    assert throughput_timeline(RESULTS, bin_s=0.5) == pytest.approx(
        [10.0, 6.0, 2.0]
    )  # 1.3 s is in [1.0, 1.5)
    assert throughput_timeline([FAILED]) == []
    with pytest.raises(ValueError, match="bin_s"):
        throughput_timeline(RESULTS, bin_s=0)


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        ([], {}),
        (["ttft:200"], {"ttft": 200.0}),
        (["tpot:5.5", "e2el:1e3"], {"tpot": 5.5, "e2el": 1000.0}),
    ],
)
def test_parse_slos(items: list[str], expected: dict[str, float]) -> None:
    assert parse_slos(items) == expected


@pytest.mark.parametrize("item", ["ttft", "latency:5", "ttft:x", "ttft:-1", "ttft:inf", "ttft:0"])
def test_parse_slos_rejects(item: str) -> None:
    with pytest.raises(ValueError, match="SLO"):
        parse_slos([item])


def test_parse_percentiles() -> None:
    assert parse_percentiles("50,95, 99.9") == (50.0, 95.0, 99.9)
    for bad in ("", "x", "101", "-1"):
        with pytest.raises(ValueError, match="percentiles"):
            parse_percentiles(bad)


def test_summarize_rejects_zero_duration() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        summarize(RESULTS, duration_s=0)


def test_poisson_arrivals_have_the_requested_mean_rate() -> None:
    times = arrival_times(4000, rate=20.0, burstiness=1.0, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.05)


def test_burstiness_changes_spread_not_mean() -> None:
    def cv(burstiness: float) -> float:
        times = arrival_times(4000, rate=10.0, burstiness=burstiness, seed=2)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        mean = sum(gaps) / len(gaps)
        return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean

    # gamma with shape k has coefficient of variation 1/sqrt(k)
    assert cv(1.0) == pytest.approx(1.0, rel=0.1)
    assert cv(4.0) == pytest.approx(0.5, rel=0.1)
    assert cv(0.25) == pytest.approx(2.0, rel=0.15)
    assert arrival_times(3, rate=math.inf, burstiness=1.0, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate"):
        arrival_times(3, rate=0.0, burstiness=1.0, seed=0)


def test_synthetic_lengths_stay_in_range() -> None:
    rng = random.Random(0)
    lengths = synthetic_lengths(1000, 100, 0.5, rng)
    assert min(lengths) >= 50 and max(lengths) <= 150
    assert synthetic_lengths(3, 10, 0.0, rng) == [10, 10, 10]
    with pytest.raises(ValueError, match="range_ratio"):
        synthetic_lengths(3, 10, 1.0, rng)
