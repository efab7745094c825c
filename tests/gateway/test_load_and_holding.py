"""The load book (in-flight counts, scraped replica metrics, ejection) and holding requests for a
model at zero replicas until discovery puts a backend (a Waker that records calls)."""

from __future__ import annotations

import asyncio

import pytest

from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.routing.holding import Holding
from kvpilot.gateway.routing.load import LoadBook, parse_replica_metrics
from kvpilot.gateway.routing.picking import ReplicaLoad
from kvpilot.gateway.routing.routes import Backend, Route, RouteTable, ScaleTarget
from kvpilot.gateway.upstream import split_events, sse_error_event

VLLM_TEXT = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="tiny"} 3.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="tiny"} 0.5
"""
OLD_VLLM_TEXT = """# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="tiny"} 0.25
"""

# Families a real replica's /metrics has around the gauges: names that start like the wanted ones
# (a histogram's lines, a longer gauge name) count for nothing; an indented sample line does.
OTHER_FAMILIES = """# HELP vllm:time_to_first_token_seconds TTFT.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_count{model_name="tiny"} 4.0
# TYPE kvpilot_requests_waiting_seconds histogram
kvpilot_requests_waiting_seconds_bucket{le="+Inf"} 9.0
vllm:num_requests_waiting_by_priority{priority="0"} 7.0
"""
MORE_SAMPLES = """# TYPE vllm:num_requests_running gauge
  vllm:num_requests_running{model_name="other"} 1.0
kvpilot_requests_running 4.0
"""
MIXED_TEXT = OTHER_FAMILIES + VLLM_TEXT + MORE_SAMPLES


@pytest.mark.parametrize(
    ("text", "expected"),
    [(VLLM_TEXT, (5.0, 0.5)), (OLD_VLLM_TEXT, (0.0, 0.25)), ("", (0, 0)),
     (MIXED_TEXT, (6.0, 0.5))],
)  # fmt: skip
def test_parse_replica_metrics(text: str, expected: tuple[float, float]) -> None:
    assert parse_replica_metrics(text) == expected


def test_load_book_counts_and_ejects() -> None:
    now = [100.0]
    book = LoadBook(eject_s=5, clock=lambda: now[0])
    a, b = Backend("a", "http://a"), Backend("b", "http://b")
    book.start("a")
    book.start("a")
    book.finish("a")
    book.report("a", 2, 0.5)  # ours (1) and one of another gateway replica
    assert book.load("a") == ReplicaLoad(1, 1, 0.5)
    book.eject("b")
    assert book.available([a, b], tried=set()) == [a]
    assert book.available([a, b], tried={"a"}) == [b]  # only ejected ones left: try them
    now[0] += 6
    assert book.available([a, b], tried=set()) == [a, b]


def test_a_stale_report_does_not_pin_a_replica_at_its_old_load() -> None:
    book = LoadBook()
    for _ in range(11):
        book.start("b")
    book.report("b", 11, 0.4)  # all ours: no other gateway's requests there
    for _ in range(3):
        book.finish("b")
    assert book.load("b").total == 8  # ours now, not the 11 of the report
    book.report("b", 12, 0.4)  # 8 ours + 4 of other gateway replicas
    book.start("b")
    assert book.load("b").total == 13
    book.report("b", 2, 0.4)  # fewer than ours (a request admitted after the scrape): no others
    assert book.load("b") == ReplicaLoad(9, 0.0, 0.4)


def test_sse_error_event_is_one_event_then_done() -> None:
    assert sse_error_event("x").startswith(b'data: {"error"')
    assert sse_error_event("x").endswith(b"\n\ndata: [DONE]\n\n")


@pytest.mark.parametrize(
    ("data", "events", "rest"),
    [
        (b"", b"", b""),
        (b'data: {"id":"x","choi', b"", b'data: {"id":"x","choi'),  # issue 40 item 5
        (b"data: {}\n\n", b"data: {}\n\n", b""),
        (b'data: {}\n\ndata: {"a', b"data: {}\n\n", b'data: {"a'),
        (b"data: {}\n\ndata: {}\n\ndata: [DO", b"data: {}\n\ndata: {}\n\n", b"data: [DO"),
        (b"data: {}\r\n\r\ndata: {", b"data: {}\r\n\r\n", b"data: {"),  # CRLF lines
        (b"data: {}\n", b"", b"data: {}\n"),  # one newline ends a line, not the event
    ],
)  # fmt: skip
def test_split_events_holds_back_an_event_still_arriving(
    data: bytes, events: bytes, rest: bytes
) -> None:
    assert split_events(data) == (events, rest)


class RecordingWaker:
    def __init__(self) -> None:
        self.calls: list[ScaleTarget] = []

    async def wake(self, target: ScaleTarget) -> None:
        self.calls.append(target)


TARGET = ScaleTarget("team-a", "tiny-md")


def held_value(metrics: GatewayMetrics) -> float | None:
    labels = {"md_namespace": "team-a", "md_name": "tiny-md", "model": "tiny"}
    return metrics.registry.get_sample_value("kvpilot_gateway_requests_held", labels)


def test_hold_until_discovery_puts_a_backend() -> None:
    async def scenario() -> None:
        table, waker, metrics = RouteTable(), RecordingWaker(), GatewayMetrics()
        table.put(Route("tiny", scale_target=TARGET))
        holding = Holding(table, waker, metrics, max_held=4)
        loop = asyncio.get_running_loop()
        held = asyncio.ensure_future(holding.hold(table.get("tiny"), loop.time() + 30))  # type: ignore[arg-type]
        while held_value(metrics) != 1:
            await asyncio.sleep(0.01)
        assert waker.calls == [TARGET]
        table.put(Route("tiny", (Backend("team-a/pod", "http://p"),), scale_target=TARGET))
        route, why = await asyncio.wait_for(held, 5)
        assert route is not None and route.backends and why == ""
        assert held_value(metrics) == 0

    asyncio.run(scenario())


def test_hold_times_out_and_the_queue_is_bounded() -> None:
    async def scenario() -> None:
        table, metrics = RouteTable(), GatewayMetrics()
        route = Route("tiny", scale_target=TARGET)
        table.put(route)
        holding = Holding(table, RecordingWaker(), metrics, max_held=1)
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(holding.hold(route, loop.time() + 0.3))
        while held_value(metrics) != 1:
            await asyncio.sleep(0.01)
        assert await holding.hold(route, loop.time() + 5) == (None, "hold_queue_full")
        assert await first == (None, "hold_timeout")

    asyncio.run(scenario())


def test_only_routes_with_a_scale_target_and_no_backend_are_held() -> None:
    holding = Holding(RouteTable(), RecordingWaker(), GatewayMetrics(), max_held=1)
    assert holding.can_hold(Route("m", scale_target=TARGET))
    assert not holding.can_hold(Route("m"))  # static config: nothing to wake
    assert not holding.can_hold(Route("m", (Backend("b", "http://b"),), scale_target=TARGET))
    assert not Holding(RouteTable(), None, GatewayMetrics(), 1).can_hold(
        Route("m", scale_target=TARGET)
    )
