"""Tests of the autoscaling simulator (`kvpilot simulate`): short traces, seconds in all."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvpilot.operator.autoscaling import policy as policy_module
from kvpilot.operator.autoscaling.policy import Bounds
from kvpilot.operator.autoscaling.simulator import main, policies, report, traces
from kvpilot.operator.autoscaling.simulator.capacity import CapacityModel
from kvpilot.operator.autoscaling.simulator.cluster import (
    FleetView,
    RunResult,
    Settings,
    simulate,
)
from kvpilot.operator.autoscaling.simulator.traces import Trace

CAPACITY = CapacityModel()
SETTINGS = Settings(min_replicas=1, max_replicas=16, initial_replicas=1)
BOUNDS = Bounds(min_replicas=1, max_replicas=16)
SLO_S = 2.0


def burst(seed: int = 0) -> Trace:
    return traces.step_burst(duration_s=1800.0, seed=seed)


def run(
    trace: Trace, name: str, bounds: Bounds = BOUNDS, settings: Settings = SETTINGS
) -> RunResult:
    return report.run_one(trace, name, CAPACITY, settings, bounds)


def test_kvpilot_in_the_simulator_is_the_real_policy() -> None:
    assert policies.decide is policy_module.decide
    kvpilot = policies.build("kvpilot", burst(), CAPACITY, SETTINGS, BOUNDS)
    result = simulate(burst(), kvpilot, CAPACITY, replace(SETTINGS, initial_replicas=3))
    # its only memory is the status dict, which is what the operator stores
    assert set(kvpilot.status) == {"recommendations", "idleSince", "lastScaleTime", "wokenAt"}  # type: ignore[attr-defined]
    assert result.scale_events


def test_step_burst_makes_kvpilot_scale_up_and_back_down() -> None:
    trace = burst()
    result = run(trace, "kvpilot")
    t = np.asarray(result.timeline["t"])
    replicas = np.asarray(result.timeline["replicas"])
    before = replicas[t < 600].max()
    during = replicas[(t >= 700) & (t < 1200)].max()
    assert during >= 2 * before
    first_up = next(at for at, old, new in result.scale_events if new > old and at >= 600)
    assert first_up <= 600 + 20  # within two 10 s ticks of the step
    assert replicas[-1] < during  # and back down after the stabilisation window


def test_oracle_never_uses_more_gpu_hours_than_fixed_max() -> None:
    for trace in (burst(), traces.poisson_spikes(duration_s=1800.0, seed=3)):
        oracle = run(trace, "oracle")
        fixed = run(trace, "fixed_max")
        assert oracle.gpu_hours <= fixed.gpu_hours
        assert fixed.gpu_hours == pytest.approx(16 * trace.duration_s / 3600)


def test_more_replicas_serve_faster() -> None:
    trace = traces.steady(duration_s=900.0, rate=6.0, seed=1)
    one = run(trace, "fixed_max", settings=Settings(1, 1, 1))
    many = run(trace, "fixed_max", settings=Settings(1, 8, 1))
    assert report.summarise(many, SLO_S)["slo_attainment"] == 1.0
    assert report.summarise(one, SLO_S)["slo_attainment"] < 0.5
    # no queueing: TTFT is prefill plus one step, well under a second
    assert float(np.max(many.ttft_s)) < 1.0


def test_same_seed_same_figures_other_seed_other_trace() -> None:
    first = report.summarise_all(
        report.run_matrix([burst(1)], ["kvpilot", "keda"], CAPACITY, SETTINGS, BOUNDS), SLO_S
    )
    again = report.summarise_all(
        report.run_matrix([burst(1)], ["kvpilot", "keda"], CAPACITY, SETTINGS, BOUNDS), SLO_S
    )
    assert first == again
    assert not np.array_equal(burst(1).arrival_s, burst(2).arrival_s)


def test_jsonl_replay_reproduces_the_trace(tmp_path: Path) -> None:
    trace = traces.poisson_spikes(duration_s=600.0, seed=5)
    path = tmp_path / "recorded.jsonl"
    traces.write_jsonl(trace, path)
    replayed = traces.replay_jsonl(path, duration_s=600.0)
    assert replayed.name == "recorded"
    assert np.allclose(replayed.arrival_s, trace.arrival_s, atol=1e-5)
    assert np.array_equal(replayed.output_tokens, trace.output_tokens)
    original = report.summarise(run(trace, "kvpilot"), SLO_S)
    assert report.summarise(run(replayed, "kvpilot"), SLO_S) == original


def test_replay_rejects_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_s": 1, "prompt_tokens": 5}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        traces.replay_jsonl(path)


def test_scale_to_zero_and_back_on_demand() -> None:
    # requests for 2 minutes, silence for 25, requests again
    arrivals = np.concatenate([np.arange(0, 120, 0.5), np.arange(1620, 1740, 0.5)])
    sizes = np.full(len(arrivals), 200, dtype=np.int64)
    trace = Trace("gap", 2000.0, arrivals.astype(np.float64), sizes, sizes)
    bounds = Bounds(min_replicas=0, max_replicas=4, scale_to_zero_idle_seconds=300.0)
    settings = Settings(min_replicas=0, max_replicas=4, initial_replicas=1)
    kvpilot = policies.KvpilotPolicy(bounds)
    result = simulate(trace, kvpilot, CAPACITY, settings)
    replicas = dict(zip(result.timeline["t"], result.timeline["replicas"], strict=True))
    assert replicas[1500.0] == 0
    assert max(r for t, r in replicas.items() if t > 1620) >= 1
    # the first requests after the gap wait for a cold start, then everyone is served
    assert np.all(np.isfinite(result.ttft_s))
    late = result.ttft_s[arrivals >= 1620]
    assert late.max() < CAPACITY.cold_start_s + 30
    assert late.min() < 1.0


def test_simulator_runs_kvpilot_with_the_crd_defaults() -> None:
    # What a ModelDeployment without autoscaling settings gets is what the benchmark measures.
    assert policies.user_bounds(1, 16) == Bounds(min_replicas=1, max_replicas=16)


def test_kvpilot_holds_steady_load_without_flapping() -> None:
    # The steady trace of the benchmark: the right fleet lies between 4 and 5 replicas, where
    # the 1-minute KV mean swings by +/-0.1; the defaults must neither flap nor serve late.
    trace = traces.steady(seed=0)
    figures = report.summarise(
        run(trace, "kvpilot", settings=replace(SETTINGS, initial_replicas=5)), SLO_S
    )
    assert figures["direction_changes_per_hour"] <= 2
    assert figures["slo_attainment"] >= 0.99
    assert figures["gpu_hours"] <= 9.0  # 4 replicas for most of the 2 hours, not 5


def test_needed_replicas_grow_with_less_headroom() -> None:
    trace = burst()
    loose = policies.needed_replicas(trace, CAPACITY, 0.5)
    tight = policies.needed_replicas(trace, CAPACITY, 1.0)
    assert np.all(loose >= tight)
    assert loose.max() > tight.max()


def test_direction_changes() -> None:
    events = [(0.0, 1, 2), (10.0, 2, 4), (20.0, 4, 3), (30.0, 3, 5), (40.0, 5, 5)]
    assert report.direction_changes(events) == 2


def test_cli_json_shape_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "--trace",
            "burst",
            "--trace",
            "steady",
            "--duration-s",
            "900",
            "--json",
            "--plots",
            str(tmp_path),
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"burst", "steady"}
    for by_policy in out.values():
        assert set(by_policy) == set(policies.NAMES)
        assert "kvpilot_slo" in by_policy
        for figures in by_policy.values():
            assert set(figures) == {
                "slo_attainment",
                "gpu_hours",
                "scale_events",
                "direction_changes_per_hour",
                "ttft_p95_s",
            }
            assert 0.0 <= figures["slo_attainment"] <= 1.0
    for name in ("burst", "steady"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--policy", "kvpilot,magic"]) == 2
    assert "magic" in capsys.readouterr().err


def test_flash_crowd_rises_tenfold_within_30_seconds() -> None:
    trace = traces.build("flash", seed=0)
    start = trace.duration_s / 3
    before = np.sum((trace.arrival_s >= start - 300) & (trace.arrival_s < start)) / 300
    during = np.sum((trace.arrival_s >= start + 30) & (trace.arrival_s < start + 330)) / 300
    assert before == pytest.approx(1.4, rel=0.15)
    assert during == pytest.approx(14.0, rel=0.1)
    assert np.sum((trace.arrival_s >= start + 700) & (trace.arrival_s < start + 1000)) / 300 < 2


class _ScaleTo:
    """Asks for a fixed count from the first tick and keeps every view it is shown."""

    name, interval_s = "scale_to", 10.0

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.views: list[FleetView] = []

    def desired(self, view: FleetView) -> int:
        self.views.append(view)
        return self.replicas


def test_the_fleet_view_has_the_rates_prometheus_would_give() -> None:
    trace = traces.steady(duration_s=900.0, rate=6.0, seed=2)
    watcher = _ScaleTo(4)
    simulate(trace, watcher, CAPACITY, replace(SETTINGS, initial_replicas=2))
    view = watcher.views[-1]  # at 890 s: 4 replicas ready for 12 minutes
    now, arrivals = view.now, trace.arrival_s
    assert view.arrivals_short_per_s == pytest.approx(
        np.sum((arrivals > now - 30) & (arrivals <= now)) / 30
    )
    assert view.arrivals_long_per_s == pytest.approx(
        np.sum((arrivals > now - 120) & (arrivals <= now)) / 120
    )
    # a steady fleet completes what arrives (arrivals one service time earlier), each request
    # with its output tokens; Little's law links the running mean, completions and service time
    earlier = np.sum((arrivals > now - 80) & (arrivals <= now - 20)) / 60
    assert view.completions_per_s == pytest.approx(earlier, rel=0.2)
    mean_output = float(np.mean(trace.output_tokens))
    assert view.tokens_per_s == pytest.approx(view.completions_per_s * mean_output, rel=0.25)
    step = CAPACITY.step_time(round(view.running_1m / view.ready))
    assert view.running_1m == pytest.approx(view.tokens_per_s * step, rel=0.1)
    assert view.cold_start_s == CAPACITY.cold_start_s  # of the 2 pods asked for, not the first 2
    assert view.ttft_p95_s is not None and view.ttft_p95_s < 1.0


def test_the_first_decision_reads_arrival_rates_over_the_trace_only() -> None:
    """Windows reaching back before t = 0 count only the time the trace covers: the fleet is
    taken to have run at its first load before the trace, so steady load reads as steady."""
    trace = traces.steady(duration_s=300.0, rate=6.0, seed=1)
    watcher = _ScaleTo(2)
    simulate(trace, watcher, CAPACITY, replace(SETTINGS, initial_replicas=2))
    first = watcher.views[0]  # at 60 s: the 120 s window holds 60 s of the trace
    assert first.now == SETTINGS.first_decision_s
    assert first.arrivals_long_per_s == pytest.approx(np.sum(trace.arrival_s <= 60.0) / 60.0)
    assert first.arrivals_long_per_s == pytest.approx(6.0, rel=0.2)


def test_kvpilot_slo_is_the_real_policy_learning_from_the_metrics() -> None:
    slo_bounds = replace(BOUNDS, ttft_slo_s=SLO_S, slo_percentile=99.0)
    kvpilot = policies.build("kvpilot_slo", burst(), CAPACITY, SETTINGS, slo_bounds)
    simulate(burst(), kvpilot, CAPACITY, replace(SETTINGS, initial_replicas=3))
    learned = kvpilot.status["capacity"]  # type: ignore[attr-defined]
    # the trace's requests, not the planner's assumed 1024 tokens: ~400 output tokens each, and
    # a cache that holds fewer of the running (longer-lived) mix than max_num_seqs
    assert learned["tokensPerRequest"] == pytest.approx(
        float(np.mean(burst().output_tokens)), rel=0.2
    )
    assert learned["slots"] < CAPACITY.max_num_seqs
    with pytest.raises(ValueError, match="TTFT SLO"):
        policies.build("kvpilot_slo", burst(), CAPACITY, SETTINGS, BOUNDS)


def test_flow_control_keeps_the_surplus_at_the_gateway() -> None:
    """Two replicas, 8 requests in flight each, 6 requests/s of ~20 s each: the replicas never
    hold more than 16, the rest waits in the fair queue, and the replicas receive only what
    they finish, well below what arrives; the timeline counts the queue as waiting."""
    trace = traces.steady(duration_s=600.0, rate=6.0, seed=3)
    watcher = _ScaleTo(2)
    limited = replace(SETTINGS, initial_replicas=2, max_in_flight_per_replica=8)
    result = simulate(trace, watcher, CAPACITY, limited)
    for view in watcher.views:
        assert view.running + view.waiting <= 8 * view.ready  # the replicas' own, held none
    last = watcher.views[-1]
    assert last.queued > 1000  # ~6/s arrive, ~0.8/s are served
    assert last.received_long_per_s < 0.3 * last.arrivals_long_per_s
    assert last.received_long_per_s == pytest.approx(last.completions_per_s, rel=0.3)
    assert max(result.timeline["waiting"]) >= last.queued
    # without the limit the replicas receive everything and the gateway queues nothing
    free = _ScaleTo(2)
    simulate(trace, free, CAPACITY, replace(SETTINGS, initial_replicas=2))
    assert free.views[-1].queued == 0
    assert free.views[-1].received_long_per_s == free.views[-1].arrivals_long_per_s


def test_a_bad_flow_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="max_in_flight_per_replica"):
        Settings(max_in_flight_per_replica=0)


@pytest.mark.parametrize("slo", [None, SLO_S], ids=["kvpilot", "kvpilot_slo"])
def test_the_gateways_signal_serves_a_burst_that_flow_control_hides(slo: float | None) -> None:
    # Flow control at the batch limit: read from the replicas alone, the burst shows as a full
    # fleet with nothing waiting and arrivals at the rate it serves.
    trace = burst()
    limited = replace(SETTINGS, initial_replicas=3, max_in_flight_per_replica=64)
    bounds = replace(BOUNDS, ttft_slo_s=slo, slo_percentile=99.0)
    prior = policies.planner_seed(CAPACITY) if slo else None
    attained = {}
    for signal in (True, False):
        scaler = policies.KvpilotPolicy(bounds, prior, gateway_signal=signal)
        result = simulate(trace, scaler, CAPACITY, limited)
        attained[signal] = report.summarise(result, SLO_S)["slo_attainment"]
    assert attained[True] > attained[False] + 0.02, attained
