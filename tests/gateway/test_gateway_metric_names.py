"""The gateway's demand the operator's autoscaler reads (contract.metric_names.GATEWAY_*) is what
kvpilot-gateway's /metrics exposes: its own metrics, moved by the real hold and fair queue, then
selected the way the operator's queries select them (metrics_reader.gateway_selector)."""

from __future__ import annotations

import asyncio
import re

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.gateway.flow.gate import Admission, FlowGate, FlowOptions
from kvpilot.gateway.flow.tenancy import Tenancy
from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.routing.holding import Holding
from kvpilot.gateway.routing.routes import Backend, Route, RouteTable, ScaleTarget
from kvpilot.operator.autoscaling import metrics_reader

TARGET = ScaleTarget("prod", "qwen-md")
FAR = 1e9


def selected(text: str, selector: str) -> float:
    """The sum of the exposed samples a PromQL selector of equality matchers picks (its
    `__name__` included): what the operator's sum() over one gateway would read."""
    matchers = {k: v.replace('\\"', '"') for k, v in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"',
                                                                 selector)}  # fmt: skip
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {"__name__": sample.name, **sample.labels}
            if all(labels.get(k) == v for k, v in matchers.items()):
                total += sample.value
    return total


async def exposed_while_busy() -> str:
    """The exposition with one request held (the model "idle" at zero replicas), one sent at
    once and two queued behind it ("qwen", one slot), two for each model through the queue."""
    table, metrics = RouteTable(), GatewayMetrics()
    qwen = Route("qwen", (Backend("a", "http://a:8000"),), scale_target=TARGET)
    adapter = Route("qwen-sql", qwen.backends, scale_target=TARGET, adapter_of="qwen")
    idle = Route("idle", scale_target=TARGET)
    for route in (qwen, adapter, idle):
        table.put(route)
    flow = FlowGate(table, FlowOptions(1, 8), metrics)
    holding = Holding(table, None, metrics, max_held=4)
    user = Tenancy("-", 0)
    first = await flow.enter(qwen, user, 10, FAR)
    assert isinstance(first, Admission)
    waiting = [asyncio.ensure_future(flow.enter(r, user, 10, FAR)) for r in (qwen, adapter)]
    held = asyncio.ensure_future(holding.hold(idle, FAR))
    await asyncio.sleep(0.01)  # everyone reaches their queue
    text = generate_latest(metrics.registry).decode()
    for task in (*waiting, held):
        task.cancel()
    await asyncio.gather(*waiting, held, return_exceptions=True)
    return text


def test_the_operators_queries_select_the_gateways_demand() -> None:
    text = asyncio.run(exposed_while_busy())
    ns, name = TARGET.namespace, TARGET.name
    assert selected(text, metrics_reader.gateway_selector(metrics_reader.HELD, ns, name)) == 1
    assert selected(text, metrics_reader.gateway_selector(metrics_reader.QUEUED, ns, name)) == 2
    arrived = metrics_reader.gateway_selector(metrics_reader.GATEWAY_ARRIVED, ns, name)
    # qwen twice and its adapter once (the proxy sends a request through the fair queue before
    # it holds it; here the hold is entered directly)
    assert selected(text, arrived) == 3
    other = metrics_reader.gateway_selector(metrics_reader.QUEUED, ns, "other-md")
    assert selected(text, other) == 0


def test_the_selectors_match_the_queries_the_operator_sends() -> None:
    for query, metric in (
        (metrics_reader.held_query("prod", "m"), metrics_reader.HELD),
        (metrics_reader.queued_query("prod", "m"), metrics_reader.QUEUED),
    ):
        assert query == f"sum({metrics_reader.gateway_selector(metric, 'prod', 'm')})"
    arrivals = metrics_reader.fleet_queries("prod", "m")["gateway_arrivals_short_per_s"]
    selector = metrics_reader.gateway_selector(metrics_reader.GATEWAY_ARRIVED, "prod", "m")
    assert arrivals == f"sum(rate({selector}[30s]))"
