"""The fair queue's asyncio side (flow/gate.py), in process: a request waits for a slot, leaves
the queue when its deadline passes or its client goes away, and a full queue is refused; and the
flags that configure it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from kvpilot.contract import metric_names
from kvpilot.gateway.cli import build_options, parse_args
from kvpilot.gateway.flow.gate import QUEUE_FULL, QUEUE_TIMEOUT, Admission, FlowGate, FlowOptions
from kvpilot.gateway.flow.tenancy import Tenancy
from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.routing.routes import Backend, Route, RouteTable, ScaleTarget

CHAT, BATCH = Tenancy("chat", 0), Tenancy("batch", 0)
FAR = 1e9  # a deadline that does not pass


def gate(max_waiting: int = 4) -> tuple[FlowGate, Route, GatewayMetrics]:
    table, metrics = RouteTable(), GatewayMetrics()
    route = Route("m", (Backend("a", "http://a:8000"),))
    table.put(route)
    return FlowGate(table, FlowOptions(1, max_waiting), metrics), route, metrics


def config_file(directory: Path) -> str:
    path = directory / "gateway.yaml"
    path.write_text("models: [{name: m, backends: ['http://a:8000']}]\n")
    return str(path)


def in_loop(scenario: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """A test that runs `scenario` on an event loop of its own."""

    def test() -> None:
        asyncio.run(scenario())

    test.__name__ = scenario.__name__
    return test


def waiting(metrics: GatewayMetrics) -> float:
    return sum(s.value for m in metrics.flow_waiting.collect() for s in m.samples)


def test_capacity_is_the_limit_times_the_replicas() -> None:
    flow, route, _ = gate()
    two = Route("m", (Backend("a", "http://a"), Backend("b", "http://b")))
    assert flow.capacity(route) == 1 and flow.capacity(two) == 2
    assert flow.capacity(Route("m")) is None  # no replica (held at zero): no limit
    assert FlowGate(RouteTable(), FlowOptions(), GatewayMetrics()).capacity(two) is None


@in_loop
async def test_a_request_waits_for_the_slot_and_gets_it_when_it_frees() -> None:
    flow, route, metrics = gate()
    first = await flow.enter(route, BATCH, 10, FAR)
    assert isinstance(first, Admission)
    second = asyncio.ensure_future(flow.enter(route, CHAT, 10, FAR))
    await asyncio.sleep(0)  # let it reach the queue
    assert not second.done() and waiting(metrics) == 1
    flow.leave(first, 10, 5)
    assert isinstance(await second, Admission) and waiting(metrics) == 0
    labels = {"model": "m", "tenant": "batch", "priority": "0", "kind": "output"}
    assert metrics.registry.get_sample_value("kvpilot_gateway_flow_tokens_total", labels) == 5


@in_loop
async def test_an_adapter_waits_for_its_base_models_replicas() -> None:
    # the base model and its adapters share the replicas, so they share one limit
    flow, route, metrics = gate()
    adapter = Route("sql", route.backends, adapter_of="m")
    first = await flow.enter(route, BATCH, 10, FAR)
    assert isinstance(first, Admission)
    second = asyncio.ensure_future(flow.enter(adapter, CHAT, 10, FAR))
    await asyncio.sleep(0)  # let it reach the queue
    assert not second.done() and waiting(metrics) == 1
    flow.leave(first, 10, 5)
    admitted = await second
    assert isinstance(admitted, Admission) and admitted.labels[0] == "sql"
    flow.leave(admitted, 10, 5)
    labels = {"model": "sql", "tenant": "chat", "priority": "0", "kind": "output"}
    assert metrics.registry.get_sample_value("kvpilot_gateway_flow_tokens_total", labels) == 5


@in_loop
async def test_a_request_past_its_deadline_leaves_the_queue() -> None:
    flow, route, metrics = gate()
    first = await flow.enter(route, BATCH, 10, FAR)
    assert isinstance(first, Admission)
    deadline = asyncio.get_running_loop().time() + 0.05
    assert await flow.enter(route, CHAT, 10, deadline) == QUEUE_TIMEOUT
    assert waiting(metrics) == 0
    flow.leave(first, 1, 1)
    assert isinstance(await flow.enter(route, CHAT, 10, FAR), Admission)  # nothing left behind


@in_loop
async def test_a_client_that_goes_away_leaves_the_queue() -> None:
    flow, route, metrics = gate()
    first = await flow.enter(route, BATCH, 10, FAR)
    assert isinstance(first, Admission)
    gone = asyncio.ensure_future(flow.enter(route, CHAT, 10, FAR))
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert waiting(metrics) == 0
    flow.leave(first, 1, 1)
    assert isinstance(await flow.enter(route, CHAT, 10, FAR), Admission)  # its slot is free


@in_loop
async def test_a_full_tenant_queue_is_refused() -> None:
    flow, route, metrics = gate(max_waiting=1)
    assert isinstance(await flow.enter(route, BATCH, 10, FAR), Admission)
    queued = asyncio.ensure_future(flow.enter(route, BATCH, 10, FAR))
    await asyncio.sleep(0)
    assert await flow.enter(route, BATCH, 10, FAR) == QUEUE_FULL
    labels = {"model": "m", "tenant": "batch", "priority": "0"}
    assert metrics.registry.get_sample_value("kvpilot_gateway_flow_refusals_total", labels) == 1
    queued.cancel()


def deployment_demand(metrics: GatewayMetrics, model: str = "m") -> tuple[float, float]:
    """(queued, arrived) as the operator's autoscaler reads them: by the ModelDeployment."""
    labels = {"md_namespace": "prod", "md_name": "m-md", "model": model}
    get = metrics.registry.get_sample_value
    queued = get(metric_names.GATEWAY_REQUESTS_QUEUED, labels)
    arrived = get(metric_names.GATEWAY_REQUESTS_ARRIVED, labels)
    return queued or 0.0, arrived or 0.0


@in_loop
async def test_the_queue_and_its_arrivals_are_exported_by_the_modeldeployment() -> None:
    # Flow control keeps the surplus here, where the runtime's waiting gauge and received
    # counter never see it: the operator reads these as the demand the replicas have not seen.
    flow, plain, metrics = gate(max_waiting=1)
    route = Route("m", plain.backends, scale_target=ScaleTarget("prod", "m-md"))
    first = await flow.enter(route, BATCH, 10, FAR)
    assert isinstance(first, Admission)
    assert deployment_demand(metrics) == (0, 1)  # sent at once: arrived, not queued
    second = asyncio.ensure_future(flow.enter(route, BATCH, 10, FAR))
    await asyncio.sleep(0)
    assert deployment_demand(metrics) == (1, 2)
    assert await flow.enter(route, BATCH, 10, FAR) == QUEUE_FULL
    assert deployment_demand(metrics) == (1, 3)  # refused, yet demand all the same
    deadline = asyncio.get_running_loop().time() + 0.05
    assert await flow.enter(route, CHAT, 10, deadline) == QUEUE_TIMEOUT
    assert deployment_demand(metrics) == (1, 4)  # the timed-out one left the gauge
    flow.leave(first, 1, 1)
    admitted = await second
    assert isinstance(admitted, Admission) and deployment_demand(metrics) == (0, 4)
    flow.leave(admitted, 1, 1)


def test_each_routed_deployments_arrivals_are_exported_at_zero_before_any_request() -> None:
    # rate() counts nothing for a series until its second sample: born at the first request,
    # the counter would hide a burst's first scrape of arrivals from the autoscaler.
    flow, plain, metrics = gate()
    flow.table.put(Route("m", plain.backends, scale_target=ScaleTarget("prod", "m-md")))
    flow.table.put(Route("static", plain.backends))  # no ModelDeployment behind it
    assert metrics.registry.get_sample_value(metric_names.GATEWAY_REQUESTS_ARRIVED, {}) is None
    flow.declare_demand_series()
    assert deployment_demand(metrics) == (0, 0)
    arrived = metric_names.GATEWAY_REQUESTS_ARRIVED
    exported = [s for m in metrics.registry.collect() for s in m.samples if s.name == arrived]
    assert [s.labels["model"] for s in exported] == ["m"]


@in_loop
async def test_an_adapters_demand_goes_to_its_base_models_deployment() -> None:
    flow, plain, metrics = gate()
    target = ScaleTarget("prod", "m-md")
    base = Route("m", plain.backends, scale_target=target)
    adapter = Route("sql", plain.backends, scale_target=target, adapter_of="m")
    first = await flow.enter(base, BATCH, 10, FAR)
    assert isinstance(first, Admission)
    queued = asyncio.ensure_future(flow.enter(adapter, CHAT, 10, FAR))
    await asyncio.sleep(0)
    assert deployment_demand(metrics, "sql") == (1, 1)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert deployment_demand(metrics, "sql") == (0, 1)


@in_loop
async def test_a_route_without_a_modeldeployment_exports_no_deployment_demand() -> None:
    flow, route, metrics = gate()  # the static config's routes have no scale target
    first = await flow.enter(route, BATCH, 10, FAR)
    assert isinstance(first, Admission)
    exported = {s.name for m in metrics.registry.collect() for s in m.samples}
    assert metric_names.GATEWAY_REQUESTS_ARRIVED not in exported
    flow.leave(first, 1, 1)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--max-in-flight-per-replica", "0"], "--max-in-flight-per-replica must be > 0"),
        (["--max-queued-per-tenant", "-1"], "--max-queued-per-tenant must be >= 0"),
        (["--fair-output-weight", "-2"], "token weights must be >= 0"),
    ],
)
def test_bad_flow_flags_are_refused(flags: list[str], says: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=says):
        build_options(parse_args(["--config", config_file(tmp_path), *flags]))


def test_flow_flags_reach_the_options(tmp_path: Path) -> None:
    flags = ["--max-in-flight-per-replica", "8", "--max-queued-per-tenant", "3",
             "--fair-input-weight", "0.5"]  # fmt: skip
    flow = build_options(parse_args(["--config", config_file(tmp_path), *flags])).flow
    assert (flow.max_in_flight_per_replica, flow.max_waiting_per_tenant) == (8, 3)
    assert (flow.weights.input, flow.weights.output) == (0.5, 2.0)
