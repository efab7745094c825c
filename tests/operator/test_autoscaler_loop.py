"""Pure parts of the autoscaler loop: which pods are scraped, mode, MetricsAvailable merging."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from kvpilot.operator import api
from kvpilot.operator.autoscaling import loop as autoscaling_loop
from kvpilot.operator.autoscaling import recording
from kvpilot.operator.autoscaling.policy import Decision, Observations, PolicyState
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.reconcile import typed_status

NOW = 1_800_000_000.0


def pod(name: str, ready: bool, ip: str | None = "127.64.0.2", **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"kvpilot.dev/node-type": "l4"}, **meta},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def test_only_ready_running_pods_are_scraped_at_their_annotated_port() -> None:
    annotated = pod("a", True, annotations={"prometheus.io/port": "9000"})
    pods = [
        annotated,
        pod("b", True, "127.64.0.3"),
        pod("c", False),
        pod("d", True, None),
        pod("e", True, deletionTimestamp="2026-01-01T00:00:00Z"),
    ]
    urls, types = autoscaling_loop.ready_pod_urls(pods, 8000)
    assert urls == {"a": "http://127.64.0.2:9000/metrics", "b": "http://127.64.0.3:8000/metrics"}
    assert types == {"a": "l4", "b": "l4"}


@pytest.mark.parametrize(
    ("spec", "builtin"),
    [
        ({}, True),
        ({"autoscaling": {"mode": "builtin"}}, True),
        ({"autoscaling": {"mode": "off"}}, False),
        ({"autoscaling": {"mode": "external"}}, False),
    ],
)
def test_only_builtin_mode_is_autoscaled(spec: dict[str, Any], builtin: bool) -> None:
    assert autoscaling_loop.is_builtin({"spec": spec}) is builtin


def test_metrics_available_keeps_other_conditions_and_its_transition_time() -> None:
    old = [
        api.Condition(type="Ready", status="True", last_transition_time="t0"),
        api.Condition(type="MetricsAvailable", status="True", last_transition_time="t1"),
    ]
    state = PolicyState()
    fresh = Decision(replicas=1, reason="hold", state=state, metrics_available=True)
    merged = {c["type"]: c for c in autoscaling_loop.metrics_condition_patch(old, fresh, "t2")}
    assert merged["Ready"]["lastTransitionTime"] == "t0"
    assert merged["MetricsAvailable"]["lastTransitionTime"] == "t1"
    lost = Decision(replicas=1, reason="prometheus down", state=state, metrics_available=False)
    merged = {c["type"]: c for c in autoscaling_loop.metrics_condition_patch(old, lost, "t2")}
    assert merged["MetricsAvailable"]["status"] == "False"
    assert merged["MetricsAvailable"]["lastTransitionTime"] == "t2"
    assert merged["MetricsAvailable"]["message"] == "prometheus down"


@pytest.mark.parametrize(
    ("plan", "planned"),
    [
        (None, False),
        ([], False),
        ([{"nodeType": "a", "fits": False}], False),
        ([{"nodeType": "a", "fits": False}, {"nodeType": "b", "fits": True}], True),
    ],
)
def test_only_planned_deployments_are_scaled(
    plan: list[dict[str, Any]] | None, planned: bool
) -> None:
    assert autoscaling_loop.is_planned(typed_status.parse({"plan": plan})) is planned


@pytest.mark.parametrize(
    ("new", "news"),
    [
        (
            {
                "desiredReplicas": 2,
                "lastDecision": "hold",
                "lastDecisionTime": "t2",
                "metrics": {"requestsWaiting": 9},
            },
            False,
        ),
        ({"desiredReplicas": 3, "lastDecision": "hold"}, True),
        ({"desiredReplicas": 2, "lastDecision": "scale up"}, True),
        ({"desiredReplicas": 2, "lastDecision": "hold", "metricsAvailable": False}, True),
    ],
)
def test_status_is_written_only_when_the_decision_changes(new: dict[str, Any], news: bool) -> None:
    old = {
        "desiredReplicas": 2,
        "lastDecision": "hold",
        "lastDecisionTime": "t1",
        "metrics": {"requestsWaiting": 1},
        "metricsAvailable": True,
    }
    assert autoscaling_loop.is_news(api.AutoscalingStatus.model_validate(old), new) is news


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        ({"kvpilot.dev/wake-requested-at": "2026-12-03T16:00:00Z"}, 1796313600.0),
        ({"kvpilot.dev/wake-requested-at": "2026-12-03T16:00:00.250000+00:00"}, 1796313600.25),
        ({"kvpilot.dev/wake-requested-at": "2026-12-03T16:00:00"}, None),  # no zone: ignored
        ({"kvpilot.dev/wake-requested-at": "soon"}, None),
        ({"kvpilot.dev/wake-requested-at": ""}, None),
        ({}, None),
    ],
)
def test_wake_time_reads_the_gateways_annotation(
    annotations: dict[str, str], expected: float | None
) -> None:
    md = {"metadata": {"name": "m", "annotations": annotations}}
    assert recording.wake_time(md) == expected


class FailingOnce(autoscaling_loop.AutoscalerLoop):
    """A loop whose first tick meets an error nothing expects (the API unreachable)."""

    def __init__(self) -> None:
        controller = SimpleNamespace(config=OperatorConfig())
        super().__init__(controller, interval_s=0.01)  # type: ignore[arg-type]
        self.ticks = 0
        self.woken: list[str] = []

    async def tick(self) -> None:
        self.ticks += 1
        if self.ticks == 1:
            raise ConnectionRefusedError("apiserver down")

    async def wake(self, md: Any) -> bool:
        self.woken.append(md["metadata"]["name"])
        return True


def test_a_failed_tick_is_logged_and_the_loop_goes_on_with_ticks_and_wakes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> FailingOnce:
        loop = FailingOnce()
        task = asyncio.create_task(loop.run())
        async with asyncio.timeout(5):
            while loop.ticks < 3:
                await asyncio.sleep(0.01)
        spec = {"autoscaling": {"mode": "builtin", "minReplicas": 0}}
        status = {"plan": [{"fits": True}]}
        md = {"metadata": {"namespace": "ns", "name": "m"}, "spec": spec, "status": status}
        loop.wake_bodies[("ns", "m")] = md  # as request_wake queues it
        loop.wakes.put_nowait(("ns", "m"))
        async with asyncio.timeout(5):
            while not loop.woken:
                await asyncio.sleep(0.01)
        task.cancel()
        return loop

    loop = asyncio.run(main())
    assert loop.woken == ["m"]
    assert "apiserver down" in caplog.text


def slo_md(slo: dict[str, Any] | None) -> dict[str, Any]:
    autoscaling: dict[str, Any] = {"minReplicas": 1, "maxReplicas": 10}
    if slo is not None:
        autoscaling["slo"] = slo
    status = {"replicas": 2, "plan": [{"nodeType": "l4", "fits": True, "maxConcurrency": 16}]}
    return {"metadata": {"namespace": "ns", "name": "m"}, "spec": {"autoscaling": autoscaling},
            "status": status}  # fmt: skip


def test_with_an_slo_the_loop_sizes_from_the_planners_seed_and_the_fleet_rates() -> None:
    # Two settled replicas, 8 running each, 4 requests/s of 100 tokens at 400 tokens/s: one
    # token per 40 ms step, a request runs 4 s. 12 arrivals/s keep 48 in flight, 59.4 with the
    # p95 margin (48 + 1.645 sqrt(48)): 4 replicas of the plan's 16 slots hold them, 3 do not.
    seen = Observations(
        current_replicas=2,
        ready_replicas=2,
        requests_running=16,
        kv_cache_usage=0.3,
        sampled_at=NOW,
        arrivals_short_per_s=12.0,
        arrivals_long_per_s=12.0,
        completions_per_s=4.0,
        requests_running_1m=16.0,
        tokens_per_s=400.0,
    )
    with_slo = slo_md({"ttftSeconds": 1})
    decision = autoscaling_loop.decision_for(with_slo, typed_status.of(with_slo), seen, NOW)
    assert decision.replicas == 4, decision.reason
    assert "SLO ttft 1s p95" in decision.reason
    assert decision.state.capacity is not None  # learned from the seed, kept in status
    assert decision.state.capacity.max_num_seqs == 16  # the plan's batch

    without = slo_md(None)
    plain = autoscaling_loop.decision_for(without, typed_status.of(without), seen, NOW)
    assert "SLO" not in plain.reason and plain.state.capacity is None


def test_a_tick_records_the_measured_cold_start_and_the_policy_sees_its_median(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Pod a was Ready 12 s after it was created, pod b 30 s; status held no cold start before.
    def ready_pod(name: str, created: str, ready: str) -> dict[str, Any]:
        found = pod(name, True, creationTimestamp=created)
        found["status"]["conditions"][0]["lastTransitionTime"] = ready
        return found

    pods = [
        ready_pod("a", "2027-01-15T08:00:00Z", "2027-01-15T08:00:12Z"),
        ready_pod("b", "2027-01-15T08:01:00Z", "2027-01-15T08:01:30Z"),
    ]
    md = slo_md({"ttftSeconds": 1})
    md["metadata"]["resourceVersion"] = "7"
    seen = Observations(current_replicas=2, ready_replicas=2, kv_cache_usage=0.6, sampled_at=NOW)
    patches: list[dict[str, Any]] = []
    loop = autoscaling_loop.AutoscalerLoop(
        SimpleNamespace(config=OperatorConfig(), client=None),  # type: ignore[arg-type]
        interval_s=10,
    )

    async def observe(*_args: Any) -> Observations:
        return seen

    monkeypatch.setattr(loop, "observe", observe)
    monkeypatch.setattr(autoscaling_loop.time, "time", lambda: NOW)
    monkeypatch.setattr(autoscaling_loop.k8s, "patch_status", lambda *args: patches.append(args[3]))
    asyncio.run(loop.scale_one(md, typed_status.of(md), pods))
    (patch,) = patches
    written = patch["autoscaling"]
    assert written["coldStart"]["medianSeconds"] == 21.0
    assert written["coldStart"]["p95Seconds"] == 30.0
    assert written["coldStart"]["samples"] == 2
    assert written["metrics"]["coldStartSeconds"] == 21.0  # what decide was given
