"""Table tests for kvpilot.operator.autoscaling.policy: one table row per rule of DESIGN.md §3.5."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvpilot.operator.autoscaling.policy import (
    Bounds,
    Decision,
    Observations,
    PolicyState,
    decide,
    wake,
)

NOW = 1_000_000.0
# Explicit targets and windows, so the tables do not move when the tuned defaults do.
BOUNDS = Bounds(
    min_replicas=1,
    max_replicas=20,
    target_queue_length=3.0,
    target_kv_cache_utilization=0.8,
    tolerance=0.1,
    scale_down_stabilization_seconds=300.0,
    scale_down_settle_s=60.0,
)


def obs(
    current: int,
    ready: int | None = None,
    requests_waiting: float = 0.0,
    requests_running: float = 0.0,
    kv_cache_usage: float = 0.0,
) -> Observations:
    return Observations(
        current_replicas=current,
        ready_replicas=current if ready is None else ready,
        requests_waiting=requests_waiting,
        requests_running=requests_running,
        kv_cache_usage=kv_cache_usage,
        sampled_at=NOW,
    )


def old_state(replicas: int, age_s: float = 1000.0) -> PolicyState:
    """History whose only entry is outside every window: no damping from the past."""
    return PolicyState(recommendations=((NOW - age_s, replicas),))


# (case id, observations, bounds, expected replicas, text expected in the reason); the state is a
# history outside every window, except where pods are starting: there the scale-up that created
# them is 60 s old, as it would be in a real run.
SINGLE_STEP = [
    ("queue without running requests", obs(2, requests_waiting=12), BOUNDS, 4, "queue"),
    (
        # 64 sequences per replica fill the batch long before the cache: a slot for each of
        # the 168 requests in flight takes ceil(2 x 168 / 128) replicas
        "full batch, roomy cache: queue scales up",
        obs(2, requests_waiting=40, requests_running=128, kv_cache_usage=0.4),
        BOUNDS,
        3,
        "queue 20.00/replica",
    ),
    (
        "queue within its target adds nothing",
        obs(4, requests_waiting=12, requests_running=120, kv_cache_usage=0.7),
        BOUNDS,
        4,
        "within tolerance",
    ),
    (
        # 0.8 x 48 / 40 = 0.96 of cache in demand: above the band although usage is on target
        "waiting requests count as kv demand",
        obs(4, requests_waiting=8, requests_running=40, kv_cache_usage=0.8),
        BOUNDS,
        5,
        "kv-cache 0.96 (usage 0.80 + queue)",
    ),
    (
        # demand 0.9 x 96 / 80 = 1.08 -> ceil(4 x 1.35) = 6; the queue alone asks for 5
        "kv demand beats the queue's slot count",
        obs(4, requests_waiting=16, requests_running=80, kv_cache_usage=0.9),
        BOUNDS,
        6,
        "kv-cache 1.08",
    ),
    (
        # ceil(8 x 0.6 / 0.72), not ceil(8 x 0.6 / 0.8) = 6: usage grows faster than load
        "kv below the band aims at its lower edge",
        obs(8, kv_cache_usage=0.6),
        BOUNDS,
        7,
        "scale down 8->7",
    ),
    ("kv signal scales up", obs(4, kv_cache_usage=0.95), BOUNDS, 5, "kv-cache"),
    ("kv inside tolerance holds", obs(4, kv_cache_usage=0.85), BOUNDS, 4, "within tolerance"),
    ("kv just outside tolerance", obs(4, kv_cache_usage=0.89), BOUNDS, 5, "ratio 1.11"),
    (
        "largest signal wins",
        obs(4, requests_waiting=3, kv_cache_usage=1.0),
        BOUNDS,
        5,
        "kv-cache",
    ),
    (
        "queue beats kv",
        obs(4, requests_waiting=30, kv_cache_usage=1.0),
        BOUNDS,
        8,
        "queue 7.50/replica",
    ),
    ("rate limit +4 when small", obs(2, requests_waiting=60), BOUNDS, 6, "rate limit 6"),
    (
        "rate limit x2 when large",
        obs(10, requests_waiting=150),
        replace(BOUNDS, max_replicas=100),
        20,
        "rate limit 20",
    ),
    ("max bound", obs(8, requests_waiting=300), BOUNDS, 16, "queue"),
    ("max bound caps", obs(18, requests_waiting=300), BOUNDS, 20, "scale up 18->20"),
    ("above max after spec change", obs(25, kv_cache_usage=0.8), BOUNDS, 20, "bounds"),
    ("below min after spec change", obs(1), replace(BOUNDS, min_replicas=3), 3, "scale up 1->3"),
    (
        "not-ready pods are not capacity",
        obs(6, ready=3, kv_cache_usage=1.0),
        BOUNDS,
        6,
        "hold at 6",
    ),
    (
        "not-ready pods: still short",
        obs(6, ready=3, requests_waiting=30, kv_cache_usage=1.0),
        BOUNDS,
        10,
        "3 ready",
    ),
    ("steady load holds", obs(5, requests_waiting=0, kv_cache_usage=0.8), BOUNDS, 5, "hold"),
]


@pytest.mark.parametrize(
    ("observations", "bounds", "expected", "reason"),
    [row[1:] for row in SINGLE_STEP],
    ids=[row[0] for row in SINGLE_STEP],
)
def test_single_decision(
    observations: Observations, bounds: Bounds, expected: int, reason: str
) -> None:
    current = observations.current_replicas
    starting = observations.ready_replicas < current
    state = old_state(current, age_s=60.0 if starting else 1000.0)
    decision = decide(observations, bounds, state, NOW)
    assert decision.replicas == expected, decision.reason
    assert reason in decision.reason
    assert decision.metrics_available


MISSING = [
    ("adapter error", Observations.unavailable(6, "prometheus unreachable"), "unreachable"),
    ("no samples", Observations(current_replicas=6, ready_replicas=0), "no samples"),
    (
        "stale samples",
        Observations(current_replicas=6, ready_replicas=6, sampled_at=NOW - 120),
        "stale",
    ),
]


@pytest.mark.parametrize(
    "observations", [row[1] for row in MISSING], ids=[row[0] for row in MISSING]
)
def test_missing_or_stale_metrics_hold_and_flag(observations: Observations) -> None:
    # History says 1 replica is plenty: a policy that trusted zeros would scale down.
    state = old_state(1)
    decision = decide(observations, BOUNDS, state, NOW)
    assert decision.replicas == 6
    assert not decision.metrics_available
    assert "never scale down" in decision.reason
    assert decision.state == state  # missing data is not a recommendation


def run(
    steps: list[tuple[float, Observations]], bounds: Bounds, via_status: bool = False
) -> list[Decision]:
    """Feed a sequence of observations, each with the replicas the previous decision chose.

    With via_status the state goes through JSON between decisions, as it does through the
    ModelDeployment's status when the operator restarts between two timer runs."""
    decisions: list[Decision] = []
    state, replicas = PolicyState(), steps[0][1].current_replicas
    for t, observed in steps:
        # A fleet that was all ready stays all ready at its new size.
        was_all_ready = observed.ready_replicas == observed.current_replicas
        ready = replicas if was_all_ready else observed.ready_replicas
        now_obs = replace(
            observed, current_replicas=replicas, ready_replicas=ready, sampled_at=NOW + t
        )
        if via_status:
            state = PolicyState.from_dict(json.loads(json.dumps(state.to_dict())))
        decision = decide(now_obs, bounds, state, NOW + t)
        decisions.append(decision)
        state, replicas = decision.state, decision.replicas
    return decisions


def quiet(kv: float, current: int = 8) -> Observations:
    return obs(current, kv_cache_usage=kv)


def test_scale_down_waits_for_window_and_takes_window_max() -> None:
    # kv 0.6 at 8 replicas wants 7, then 0.3 wants 4 (aiming at the band's lower edge, 0.72).
    steps = [(0.0, quiet(0.8)), (100.0, quiet(0.6)), (200.0, quiet(0.3)), (299.0, quiet(0.3))]
    steps += [(301.0, quiet(0.3)), (401.0, quiet(0.3))]
    decisions = run(steps, BOUNDS)
    # 8 stays until t=0's 8 leaves the window (t>300), then the max of the window (7 from t=100)
    # applies, and only after t=100 leaves it does the fleet go to 4.
    assert [d.replicas for d in decisions] == [8, 8, 8, 8, 7, 4]
    assert "scale down 8->7 (window max/min 7)" in decisions[4].reason


def test_scale_down_waits_for_the_last_change_to_settle() -> None:
    # The window has long passed, but the fleet changed 30 s ago: its 1-minute KV mean still
    # mixes in the old fleet, so the shrink waits until 60 s after the change.
    history = ((NOW - 1000.0, 8),)
    recent = PolicyState(recommendations=history, last_scale_time=NOW - 30.0)
    held = decide(quiet(0.3), BOUNDS, recent, NOW)
    assert held.replicas == 8
    assert "last change under 60s ago" in held.reason
    settled = decide(quiet(0.3), BOUNDS, replace(recent, last_scale_time=NOW - 60.0), NOW)
    assert settled.replicas == 4
    # a scale-up does not wait
    assert decide(quiet(1.0), BOUNDS, recent, NOW).replicas == 10
    # a scale-down window shorter than the settle time caps it: 20 s was asked for
    quick = replace(BOUNDS, scale_down_stabilization_seconds=20.0)
    assert decide(quiet(0.3), quick, recent, NOW).replicas == 4


def test_fresh_state_does_not_scale_down_at_once() -> None:
    # An operator that lost its state must not shrink the fleet on its first look.
    first = decide(quiet(0.1), BOUNDS, PolicyState(), NOW)
    assert first.replicas == 8
    assert "down window" in first.reason


def test_scale_up_is_immediate_without_up_window() -> None:
    first = decide(obs(2, kv_cache_usage=1.0), BOUNDS, PolicyState(), NOW)
    assert first.replicas == 3


def test_scale_up_stabilisation_takes_window_min() -> None:
    bounds = replace(BOUNDS, scale_up_stabilization_seconds=30.0)
    steps = [(0.0, obs(2, kv_cache_usage=0.8)), (10.0, obs(2, requests_waiting=15))]
    steps += [(31.0, obs(2, requests_waiting=15))]
    replicas = [d.replicas for d in run(steps, bounds)]
    assert replicas == [2, 2, 5]


def test_restart_from_status_dict_loses_nothing() -> None:
    steps = [(0.0, quiet(0.8)), (100.0, quiet(0.3)), (200.0, quiet(0.3)), (310.0, quiet(0.3))]
    in_memory = run(steps, BOUNDS)
    restarted = run(steps, BOUNDS, via_status=True)
    assert [d.replicas for d in restarted] == [d.replicas for d in in_memory] == [8, 8, 8, 4]
    assert [d.state for d in restarted] == [d.state for d in in_memory]
    # What the status keeps is what stops the early scale-down: an operator that lost it after
    # t=200 would hold at 8 on its first look at t=310 (fresh seed), then wait a full window.
    lost = decide(replace(steps[3][1], sampled_at=NOW + 310), BOUNDS, PolicyState(), NOW + 310)
    assert lost.replicas == 8


def test_state_dict_round_trip_and_rejects_garbage() -> None:
    state = PolicyState(((NOW, 3), (NOW + 10, 5)), idle_since=NOW, last_scale_time=NOW + 10)
    assert PolicyState.from_dict(state.to_dict()) == state
    assert PolicyState.from_dict(None) == PolicyState()
    with pytest.raises(ValueError, match="malformed"):
        PolicyState.from_dict({"recommendations": [["soon", 3]]})


def test_history_stays_small_under_steady_load() -> None:
    steps = [(10.0 * i, quiet(0.8)) for i in range(100)]
    assert len(run(steps, BOUNDS)[-1].state.recommendations) == 1


def test_scale_to_zero_after_idle_and_back_on_demand() -> None:
    bounds = replace(BOUNDS, min_replicas=0, max_replicas=10, scale_to_zero_idle_seconds=600.0)
    idle = obs(2)
    steps = [(0.0, idle), (301.0, idle), (590.0, idle), (600.0, idle), (700.0, idle)]
    steps += [(710.0, Observations(0, requests_waiting=4, sampled_at=NOW + 710))]
    decisions = run(steps, bounds)
    # 2 -> 1 after the down window (one replica stays while merely idle), 0 after the idle period,
    # stays at zero without demand, and the first waiting requests bring it back at once.
    assert [d.replicas for d in decisions] == [2, 1, 1, 0, 0, 2]
    assert "scale to zero" in decisions[3].reason
    assert decisions[2].state.idle_since == NOW


def test_busy_fleet_with_min_zero_is_not_scaled_to_zero() -> None:
    bounds = replace(BOUNDS, min_replicas=0, max_replicas=10, scale_to_zero_idle_seconds=60.0)
    steps = [(float(t), obs(2, requests_running=1, kv_cache_usage=0.05)) for t in (0, 400, 800)]
    assert [d.replicas for d in run(steps, bounds)] == [2, 1, 1]


def test_scale_from_zero_is_rate_limited() -> None:
    zero = Observations(0, requests_waiting=100, sampled_at=NOW)
    assert decide(zero, BOUNDS, PolicyState(), NOW).replicas == 4


def test_last_scale_time_recorded_only_on_change() -> None:
    held = decide(obs(4, kv_cache_usage=0.8), BOUNDS, old_state(4), NOW)
    assert held.state.last_scale_time is None
    scaled = decide(obs(4, kv_cache_usage=1.0), BOUNDS, old_state(4), NOW)
    assert scaled.state.last_scale_time == NOW


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_replicas": 5, "max_replicas": 2}, "above maxReplicas"),
        ({"target_queue_length": 0}, "targetQueueLength"),
        ({"target_kv_cache_utilization": 1.5}, "targetKVCacheUtilization"),
        ({"tolerance": 1.0}, "tolerance"),
        ({"scale_down_stabilization_seconds": -1}, "windows"),
        ({"scale_down_settle_s": -1}, "windows"),
        ({"max_scale_up_factor": 0.5}, "rate limits"),
    ],
)
def test_bounds_validation(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Bounds(**kwargs)  # type: ignore[arg-type]


def test_negative_current_is_rejected() -> None:
    with pytest.raises(ValueError, match="current replicas"):
        decide(Observations(current_replicas=-1), BOUNDS, PolicyState(), NOW)


ZERO_OK = replace(BOUNDS, min_replicas=0, max_replicas=10, scale_to_zero_idle_seconds=600.0)
SCALED_TO_ZERO = PolicyState(idle_since=NOW - 700, last_scale_time=NOW - 100)


# (case, mode, bounds, state, current replicas, wake time relative to NOW, expected replicas or
# None when the wake changes nothing)
WAKES = [
    ("newer than the scale to zero", "builtin", ZERO_OK, SCALED_TO_ZERO, 0, -1.0, 1),
    ("older than the scale to zero", "builtin", ZERO_OK, SCALED_TO_ZERO, 0, -200.0, None),
    ("no decision yet", "builtin", ZERO_OK, PolicyState(), 0, -1.0, 1),
    (
        "already acted on",
        "builtin",
        ZERO_OK,
        replace(SCALED_TO_ZERO, woken_at=NOW - 1),
        0,
        -1.0,
        None,
    ),
    (
        "a later wake after one acted on",
        "builtin",
        ZERO_OK,
        replace(SCALED_TO_ZERO, woken_at=NOW - 30),
        0,
        -1.0,
        1,
    ),
    ("replicas running already", "builtin", ZERO_OK, SCALED_TO_ZERO, 2, -1.0, None),
    (
        "minReplicas above zero",
        "builtin",
        replace(ZERO_OK, min_replicas=1),
        PolicyState(),
        0,
        -1,
        None,
    ),
    ("max bound of one", "builtin", replace(ZERO_OK, max_replicas=1), SCALED_TO_ZERO, 0, -1.0, 1),
    ("mode off", "off", ZERO_OK, SCALED_TO_ZERO, 0, -1.0, None),
    ("mode external", "external", ZERO_OK, SCALED_TO_ZERO, 0, -1.0, None),
    ("no wake annotation", "builtin", ZERO_OK, SCALED_TO_ZERO, 0, None, None),
]


@pytest.mark.parametrize(
    ("mode", "bounds", "state", "current", "requested", "expected"),
    [case[1:] for case in WAKES],
    ids=[case[0] for case in WAKES],
)
def test_wake(
    mode: str,
    bounds: Bounds,
    state: PolicyState,
    current: int,
    requested: float | None,
    expected: int | None,
) -> None:
    requested_at = None if requested is None else NOW + requested
    decision = wake(mode, bounds, state, current, requested_at, NOW)
    if expected is None:
        assert decision is None
        return
    assert decision is not None
    assert decision.replicas == expected
    assert decision.reason.startswith(f"scale up 0->{expected}: a request is waiting")
    assert decision.state.woken_at == requested_at
    assert decision.state.idle_since == requested_at  # the idle clock restarts from the wake
    assert decision.state.last_scale_time == NOW
    assert PolicyState.from_dict(json.loads(json.dumps(decision.state.to_dict()))) == (
        decision.state
    )


def test_a_woken_replica_gets_a_full_idle_period() -> None:
    # Idle since long before the scale to zero; the wake must not let the first look after the
    # replica turns ready take it straight back to zero.
    woken = wake("builtin", ZERO_OK, SCALED_TO_ZERO, 0, NOW, NOW)
    assert woken is not None and woken.replicas == 1
    starting = Observations.unavailable(1, "no samples from ready pods")
    held = decide(starting, ZERO_OK, woken.state, NOW + 20)
    assert held.replicas == 1
    idle = replace(obs(1), sampled_at=NOW + 60)
    assert decide(idle, ZERO_OK, held.state, NOW + 60).replicas == 1
    later = replace(obs(1), sampled_at=NOW + 599)
    assert decide(later, ZERO_OK, held.state, NOW + 599).replicas == 1
    gone = replace(obs(1), sampled_at=NOW + 600)
    assert decide(gone, ZERO_OK, held.state, NOW + 600).replicas == 0
    # The same wake seen again (a later event of the object) changes nothing.
    assert wake("builtin", ZERO_OK, held.state, 0, NOW, NOW + 601) is None
