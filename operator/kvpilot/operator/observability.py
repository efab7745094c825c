"""The operator's own health and Prometheus metrics: `/healthz`, `/readyz` and `/metrics` on one
port.

`/healthz` says the process answers (a standby too: kopf's own probe endpoint starts only with
kopf, once this instance holds the Lease). `/readyz` says the instance knows its role: it has
learned from the API who holds the leader-election Lease, and, if it is the holder, kopf has run
the startup handler (settings applied, the passes, re-planner and autoscaler started); a standby
is ready as soon as it knows another instance holds the Lease (`Readiness`). Until then it answers
503 with what is missing. A standby that never turned Ready would stall the operator
Deployment's rolling update.

Handlers call the plain `record_*` functions; `start_server(port)` serves them from a daemon thread
(stdlib HTTP server, so it runs beside kopf's event loop without touching it) and returns a callable
that stops it. The metrics live in their own registry, not prometheus-client's global one, so the
process exposes exactly these series and tests can build a fresh set.

Label values are small closed sets (outcomes, directions, sources) or short reason codes chosen by
the caller, never object names, so the number of series stays bounded however many
ModelDeployments the cluster holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

OUTCOMES = frozenset({"success", "error", "invalid"})
DIRECTIONS = frozenset({"up", "down", "none"})
SOURCES = frozenset({"prometheus", "pods"})
# Reconciles call the API a handful of times: milliseconds normally, seconds when it is slow.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MAX_REASON_LENGTH = 64


@dataclass
class OperatorMetrics:
    """One registry with the operator's series; module-level `METRICS` is the process's own."""

    registry: CollectorRegistry = field(
        default_factory=lambda: CollectorRegistry(auto_describe=True)
    )

    def __post_init__(self) -> None:
        r = self.registry
        self.reconciles = Counter(
            "kvpilot_operator_reconcile", "Reconcile passes by outcome", ["outcome"], registry=r
        )
        self.reconcile_seconds = Histogram(
            "kvpilot_operator_reconcile_duration_seconds",
            "Wall time of one reconcile pass",
            ["outcome"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.plan_failures = Counter(
            "kvpilot_operator_plan_failures",
            "Plans that placed nothing, by reason",
            ["reason"],
            registry=r,
        )
        self.scale_decisions = Counter(
            "kvpilot_operator_scale_decisions",
            "Autoscaler decisions by direction",
            ["direction"],
            registry=r,
        )
        self.metrics_errors = Counter(
            "kvpilot_operator_metrics_source_errors",
            "Failed reads of the runtime metrics, by source",
            ["source"],
            registry=r,
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


METRICS = OperatorMetrics()


def _one_of(value: str, allowed: frozenset[str], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {sorted(allowed)}, got {value!r}")
    return value


def record_reconcile(
    duration_s: float, outcome: str, metrics: OperatorMetrics | None = None
) -> None:
    """One reconcile pass: `outcome` is success, error (API trouble, retried) or invalid (spec)."""
    if duration_s < 0:
        raise ValueError(f"duration must be >= 0 seconds, got {duration_s}")
    m = metrics or METRICS
    _one_of(outcome, OUTCOMES, "outcome")
    m.reconciles.labels(outcome=outcome).inc()
    m.reconcile_seconds.labels(outcome=outcome).observe(duration_s)


def record_plan_failure(reason: str, metrics: OperatorMetrics | None = None) -> None:
    """A plan with no fitting node type or an unusable spec; `reason` is a short code."""
    if not reason or len(reason) > MAX_REASON_LENGTH:
        raise ValueError(f"reason must be a short code (1-{MAX_REASON_LENGTH} chars): {reason!r}")
    (metrics or METRICS).plan_failures.labels(reason=reason).inc()


def record_scale(direction: str, metrics: OperatorMetrics | None = None) -> None:
    _one_of(direction, DIRECTIONS, "direction")
    (metrics or METRICS).scale_decisions.labels(direction=direction).inc()


def record_metrics_error(source: str, metrics: OperatorMetrics | None = None) -> None:
    _one_of(source, SOURCES, "source")
    (metrics or METRICS).metrics_errors.labels(source=source).inc()


@dataclass
class Readiness:
    """Set while waiting for the Lease (cli.wait_for_lease) and by the startup handler; read by
    `/readyz`. Plain booleans, each written by one thread.

    A standby is ready once it knows another instance holds the Lease: it has nothing to do
    until then, and a rollout of two replicas waits for both to turn Ready."""

    started: bool = False
    lease_known: bool = False
    standby: bool = False

    def missing(self) -> list[str]:
        missing = []
        if not self.lease_known:
            missing.append("the leader-election Lease's holder is not known (API unreachable?)")
        if not self.started and not self.standby:
            missing.append("kopf has not run the startup handler")
        return missing

    def is_ready(self) -> bool:
        return not self.missing()


class ServerHandle:
    """What `start_server` returns: call it to stop the server; `port` is the bound port."""

    def __init__(self, server: ThreadingHTTPServer, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread
        self.port: int = server.server_address[1]

    def __call__(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _handler(
    metrics: OperatorMetrics, is_healthy: Callable[[], bool], readiness: Readiness | None
) -> type:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            route = self.path.split("?", 1)[0]
            if route == "/healthz":
                healthy = is_healthy()
                body = b"ok\n" if healthy else b"unhealthy\n"
                self._send(200 if healthy else 503, "text/plain; charset=utf-8", body)
            elif route == "/readyz":
                missing = ["readiness is not tracked"] if readiness is None else readiness.missing()
                body = ("not ready: " + "; ".join(missing) if missing else "ready").encode()
                self._send(503 if missing else 200, "text/plain; charset=utf-8", body + b"\n")
            elif route == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, metrics.exposition())
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return  # probes every few seconds would flood the operator's log

    return Handler


def start_server(
    port: int,
    host: str = "0.0.0.0",
    metrics: OperatorMetrics | None = None,
    is_healthy: Callable[[], bool] = lambda: True,
    readiness: Readiness | None = None,
) -> ServerHandle:
    """Serve /healthz, /readyz and /metrics on host:port (0 picks a free port) until the handle
    is called."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    server = ThreadingHTTPServer((host, port), _handler(metrics or METRICS, is_healthy, readiness))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="kvpilot-metrics", daemon=True)
    thread.start()
    return ServerHandle(server, thread)
