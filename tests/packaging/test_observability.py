"""The operator's /healthz and /metrics server, over real HTTP on a free port."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator import observability as obs


@pytest.fixture
def metrics() -> obs.OperatorMetrics:
    return obs.OperatorMetrics()


@pytest.fixture
def server(metrics: obs.OperatorMetrics) -> Iterator[obs.ServerHandle]:
    handle = obs.start_server(0, host="127.0.0.1", metrics=metrics)
    yield handle
    handle()


def fetch(port: int, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_healthz_answers_ok(server: obs.ServerHandle) -> None:
    status, content_type, body = fetch(server.port, "/healthz")
    assert (status, body) == (200, "ok\n")
    assert content_type.startswith("text/plain")


def test_unknown_path_is_404(server: obs.ServerHandle) -> None:
    assert fetch(server.port, "/nope")[0] == 404


def test_unhealthy_callback_gives_503(metrics: obs.OperatorMetrics) -> None:
    handle = obs.start_server(0, host="127.0.0.1", metrics=metrics, is_healthy=lambda: False)
    try:
        assert fetch(handle.port, "/healthz")[:1] == (503,)
    finally:
        handle()


def test_metrics_expose_what_was_recorded(
    server: obs.ServerHandle, metrics: obs.OperatorMetrics
) -> None:
    obs.record_reconcile(0.2, "success", metrics)
    obs.record_reconcile(0.03, "success", metrics)
    obs.record_reconcile(7.0, "error", metrics)
    obs.record_plan_failure("no-fit", metrics)
    obs.record_scale("up", metrics)
    obs.record_scale("up", metrics)
    obs.record_scale("down", metrics)
    obs.record_metrics_error("prometheus", metrics)
    status, content_type, body = fetch(server.port, "/metrics")
    assert status == 200 and content_type.startswith("text/plain; version=")
    got = samples(body)
    assert got[("kvpilot_operator_reconcile_total", (("outcome", "success"),))] == 2
    assert got[("kvpilot_operator_reconcile_total", (("outcome", "error"),))] == 1
    count = ("kvpilot_operator_reconcile_duration_seconds_count", (("outcome", "success"),))
    total = ("kvpilot_operator_reconcile_duration_seconds_sum", (("outcome", "success"),))
    assert got[count] == 2 and got[total] == pytest.approx(0.23)
    le_half = (
        "kvpilot_operator_reconcile_duration_seconds_bucket",
        (("le", "0.5"), ("outcome", "error")),
    )
    assert got[le_half] == 0  # the 7 s pass lands in a higher bucket
    assert got[("kvpilot_operator_plan_failures_total", (("reason", "no-fit"),))] == 1
    assert got[("kvpilot_operator_scale_decisions_total", (("direction", "up"),))] == 2
    assert got[("kvpilot_operator_scale_decisions_total", (("direction", "down"),))] == 1
    errors = ("kvpilot_operator_metrics_source_errors_total", (("source", "prometheus"),))
    assert got[errors] == 1


def test_registry_is_private_to_the_operator(server: obs.ServerHandle) -> None:
    names = {f.name for f in text_string_to_metric_families(fetch(server.port, "/metrics")[2])}
    assert names and all(name.startswith("kvpilot_operator_") for name in names)


@pytest.mark.parametrize(
    ("call", "bad"),
    [
        (lambda m: obs.record_reconcile(-1.0, "success", m), "duration"),
        (lambda m: obs.record_reconcile(1.0, "ok", m), "outcome"),
        (lambda m: obs.record_scale("sideways", m), "direction"),
        (lambda m: obs.record_metrics_error("graphite", m), "source"),
        (lambda m: obs.record_plan_failure("", m), "reason"),
        (lambda m: obs.record_plan_failure("x" * 65, m), "reason"),
    ],
)
def test_bad_labels_are_rejected(metrics: obs.OperatorMetrics, call, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        call(metrics)


def test_default_functions_write_the_process_registry() -> None:
    before = obs.METRICS.registry.get_sample_value(
        "kvpilot_operator_scale_decisions_total", {"direction": "none"}
    )
    obs.record_scale("none")
    after = obs.METRICS.registry.get_sample_value(
        "kvpilot_operator_scale_decisions_total", {"direction": "none"}
    )
    assert after == (before or 0) + 1


def test_stop_closes_the_port(metrics: obs.OperatorMetrics) -> None:
    handle = obs.start_server(0, host="127.0.0.1", metrics=metrics)
    assert fetch(handle.port, "/healthz")[0] == 200
    handle()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{handle.port}/healthz", timeout=2)


def test_port_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError, match="port"):
        obs.start_server(70000)


@pytest.mark.parametrize(
    ("started", "lease_known", "status", "says"),
    [
        (False, False, 503, "startup handler"),
        (True, False, 503, "Lease's holder is not known"),
        (False, True, 503, "startup handler"),
        (True, True, 200, "ready"),
    ],
)
def test_readyz_waits_for_the_start_and_the_lease(
    metrics: obs.OperatorMetrics, started: bool, lease_known: bool, status: int, says: str
) -> None:
    readiness = obs.Readiness(started=started, lease_known=lease_known)
    code, body = readyz(metrics, readiness)
    assert code == status and says in body


@pytest.mark.parametrize(
    ("lease_known", "status", "says"),
    [
        (True, 200, "ready"),  # another instance acts: nothing to wait for
        (False, 503, "Lease's holder is not known"),
    ],
)
def test_a_standby_is_ready_once_it_knows_who_holds_the_lease(
    metrics: obs.OperatorMetrics, lease_known: bool, status: int, says: str
) -> None:
    code, body = readyz(metrics, obs.Readiness(lease_known=lease_known, standby=True))
    assert code == status and says in body


def readyz(metrics: obs.OperatorMetrics, readiness: obs.Readiness) -> tuple[int, str]:
    """/readyz's code and body from a server tracking `readiness`."""
    handle = obs.start_server(0, host="127.0.0.1", metrics=metrics, readiness=readiness)
    try:
        code, _, body = fetch(handle.port, "/readyz")
        return code, body
    finally:
        handle()


def test_readyz_without_tracking_is_never_ready(server: obs.ServerHandle) -> None:
    assert fetch(server.port, "/readyz")[0] == 503
