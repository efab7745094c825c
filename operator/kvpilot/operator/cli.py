"""`kvpilot-operator run [--namespace NS] [--standalone] [--config FILE]`.

Starts the kopf operator against the current kubeconfig (or the in-cluster service account). Without
`--standalone`, the instance first waits for the leader-election Lease in the operator's namespace
(lease.py) and starts kopf only once it holds it: one decision says which instance runs kopf's
handlers, the autoscaler and the re-planner. A standby answers /healthz and /readyz on the metrics
port meanwhile. An instance that loses the Lease stops and exits 1, to come back as a standby.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
from pathlib import Path

import kopf
from kubernetes import client as k8s_client

from kvpilot.operator import config as operator_config
from kvpilot.operator import handlers, k8s, observability
from kvpilot.operator.controller import Controller
from kvpilot.operator.lease import LeaderLease, default_identity, operator_namespace

EXIT_LEASE_LOST = 1
REGISTERED = handlers  # imported for its decorators, which register the handlers with kopf
log = logging.getLogger("kvpilot.operator")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpilot-operator", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the operator")
    run.add_argument("--namespace", default="", help="watch one namespace (default: all)")
    run.add_argument(
        "--standalone",
        action="store_true",
        help="the only instance: act at once, with no leader-election Lease",
    )
    run.add_argument("--config", type=Path, help="operator config YAML (node types, image, ...)")
    run.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config")
    run.add_argument(
        "--liveness",
        default="",
        help="kopf's own probe endpoint, e.g. http://0.0.0.0:8080/healthz (it answers only once"
        " this instance holds the Lease; probe /healthz on --metrics-port for a standby too)",
    )
    run.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve the operator's own /healthz, /readyz and /metrics on this port (default: off)",
    )
    run.add_argument("--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = operator_config.load(args.config)
    except (OSError, ValueError) as error:
        print(f"kvpilot-operator: {error}", file=sys.stderr)
        return 2
    namespace = args.namespace or cfg.namespace
    kopf.configure(verbose=args.verbose)
    client = k8s.api_client(args.kubeconfig)
    lease = None if args.standalone else leader_lease(client, namespace, cfg)
    readiness = observability.Readiness(lease_known=lease is None)
    stop_metrics = (
        observability.start_server(args.metrics_port, readiness=readiness)
        if args.metrics_port
        else None
    )
    # Set by the Lease keeper on kopf's loop: kopf stops, and so does this process. An asyncio
    # Event, not a threading one: kopf waits for a threading.Event in an executor thread that
    # nothing wakes on SIGTERM, so a clean stop hung until SIGKILL and never let the Lease go.
    lost = asyncio.Event()
    try:
        if lease is not None:
            wait_for_lease(lease, readiness)
        kopf.run(
            clusterwide=not namespace,
            namespaces=[namespace] if namespace else (),
            standalone=True,  # the Lease decides who acts; kopf's peering would be a second say
            liveness_endpoint=args.liveness or None,
            stop_flag=lost,
            memo=kopf.Memo(
                controller=Controller(client=client, config=cfg),
                readiness=readiness,
                lease=lease,
                lease_lost=lost,
            ),
        )
    finally:
        if stop_metrics is not None:
            stop_metrics()
    return EXIT_LEASE_LOST if lost.is_set() else 0


def wait_for_lease(lease: LeaderLease, readiness: observability.Readiness) -> None:
    """Wait as a standby (ready: it knows who acts) until this instance holds the Lease."""

    def follow() -> None:
        readiness.lease_known = lease.state_known
        readiness.standby = lease.holder != lease.identity

    log.info("waiting for Lease %s/%s as %s", lease.namespace, lease.name, lease.identity)
    lease.wait_until_held(follow)


def leader_lease(
    client: k8s_client.ApiClient, namespace: str, cfg: operator_config.OperatorConfig
) -> LeaderLease:
    """The Lease that lets one instance act; a crashed holder is replaced after three autoscaler
    intervals (15 s at least)."""
    duration = max(15, math.ceil(3 * cfg.autoscaler_interval_seconds))
    return LeaderLease(client, operator_namespace(namespace), default_identity(), duration)


if __name__ == "__main__":
    sys.exit(main())
