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
import signal
import sys
import threading
from pathlib import Path

import kopf
from kubernetes import client as k8s_client

from kvpilot.contract import k8s
from kvpilot.operator import config as operator_config
from kvpilot.operator import handlers, observability
from kvpilot.operator.lease import LeaderLease, default_identity, operator_namespace
from kvpilot.operator.reconcile.controller import Controller

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
    stopping = Stopping()
    signal.signal(signal.SIGTERM, stopping.on_signal)  # kopf's own handlers replace these
    signal.signal(signal.SIGINT, stopping.on_signal)
    try:
        if lease is not None and not wait_for_lease(lease, readiness, stopping.asked):
            return 0  # a standby told to stop: it holds nothing to let go
        if not stopping.asked.is_set():
            kopf.run(
                clusterwide=not namespace,
                namespaces=[namespace] if namespace else (),
                standalone=True,  # the Lease decides who acts; kopf's peering would be a second say
                liveness_endpoint=args.liveness or None,
                stop_flag=stopping.flag,
                memo=kopf.Memo(
                    controller=Controller(client=client, config=cfg),
                    readiness=readiness,
                    lease=lease,
                    lease_lost=stopping.lease_lost,
                ),
            )
    finally:
        if lease is not None:  # kopf's cleanup let it go, unless it stopped before its startup ran
            lease.release()
        if stop_metrics is not None:
            stop_metrics()
    return EXIT_LEASE_LOST if stopping.lost else 0


class Stopping:
    """kopf's stop flag, and why it was raised.

    SIGTERM (a pod's deletion) must let the Lease go whenever it comes. kopf handles it once its
    loop runs; before that -- a standby waiting, or the instant between taking the Lease and kopf's
    start -- Python's default action killed the process holding the Lease, and a standby then
    waited out leaseDurationSeconds. These handlers set the same flag kopf stops on.
    The flag is an asyncio Event, not a threading one: kopf waits for a threading.Event in an
    executor thread that nothing wakes on SIGTERM, so a clean stop hung until SIGKILL.
    """

    def __init__(self) -> None:
        self.flag = asyncio.Event()
        self.asked = threading.Event()  # a signal came before kopf's handlers took over
        self.lost = False

    def lease_lost(self) -> None:
        """Called on kopf's loop by the Lease keeper: stop, and exit 1 to come back as a standby."""
        self.lost = True
        self.flag.set()

    def on_signal(self, signum: int, _frame: object) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        self.asked.set()  # wakes a standby's wait at once
        try:  # kopf's loop may be running already, its handlers not yet added
            asyncio.get_running_loop().call_soon_threadsafe(self.flag.set)
        except RuntimeError:  # no loop yet: kopf finds the flag set when it starts
            self.flag.set()


def wait_for_lease(
    lease: LeaderLease, readiness: observability.Readiness, stop: threading.Event
) -> bool:
    """Wait as a standby (ready: it knows who acts) until this instance holds the Lease (True)
    or `stop` is set (False)."""

    def follow() -> None:
        readiness.lease_known = lease.state_known
        readiness.standby = lease.holder != lease.identity

    log.info("waiting for Lease %s/%s as %s", lease.namespace, lease.name, lease.identity)
    return lease.wait_until_held(follow, stop)


def leader_lease(
    client: k8s_client.ApiClient, namespace: str, cfg: operator_config.OperatorConfig
) -> LeaderLease:
    """The Lease that lets one instance act; a crashed holder is replaced after three autoscaler
    intervals (15 s at least)."""
    duration = max(15, math.ceil(3 * cfg.autoscaler_interval_seconds))
    return LeaderLease(client, operator_namespace(namespace), default_identity(), duration)


if __name__ == "__main__":
    sys.exit(main())
