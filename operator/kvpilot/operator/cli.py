"""`kvpilot-operator run [--namespace NS] [--standalone] [--config FILE]`.

Starts the kopf operator against the current kubeconfig (or the in-cluster service account). Without
`--standalone`, instances take part in kopf peering, so only the highest-priority one acts; the
peering object is created here when its CRD is installed (crds/kopf.dev_peerings.yaml). The
autoscaler loop, a thread kopf does not pause, runs only in the instance holding a Lease
(lease.py) in the operator's namespace.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import sys
from pathlib import Path

import kopf
from kubernetes import client as k8s_client
from kubernetes.client.exceptions import ApiException

from kvpilot.operator import config as operator_config
from kvpilot.operator import handlers, k8s, observability
from kvpilot.operator.controller import Controller
from kvpilot.operator.lease import LeaderLease, default_identity, operator_namespace

PEERING_NAME = "kvpilot"
REGISTERED = handlers  # imported for its decorators, which register the handlers with kopf
log = logging.getLogger("kvpilot.operator")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpilot-operator", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the operator")
    run.add_argument("--namespace", default="", help="watch one namespace (default: all)")
    run.add_argument("--standalone", action="store_true", help="no peering with other instances")
    run.add_argument("--config", type=Path, help="operator config YAML (node types, image, ...)")
    run.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config")
    run.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority; the highest live instance acts (default: random in 1..1000)",
    )
    run.add_argument("--liveness", default="", help="e.g. http://0.0.0.0:8080/healthz")
    run.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve the operator's own /healthz and /metrics on this port (default: off)",
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
    standalone = args.standalone or not ensure_peering(client, namespace)
    readiness = observability.Readiness()
    stop_metrics = (
        observability.start_server(args.metrics_port, readiness=readiness)
        if args.metrics_port
        else None
    )
    try:
        kopf.run(
            clusterwide=not namespace,
            namespaces=[namespace] if namespace else (),
            standalone=standalone,
            peering_name=None if standalone else PEERING_NAME,
            # Equal priorities make kopf pause every instance, so replicas that were not given one
            # draw their own: the highest acts, the others wait until its peering record expires.
            priority=args.priority if args.priority is not None else random.randint(1, 1000),
            liveness_endpoint=args.liveness or None,
            memo=kopf.Memo(
                controller=Controller(client=client, config=cfg),
                readiness=readiness,
                lease=None if standalone else autoscaler_lease(client, namespace, cfg),
            ),
        )
    finally:
        if stop_metrics is not None:
            stop_metrics()
    return 0


def autoscaler_lease(
    client: k8s_client.ApiClient, namespace: str, cfg: operator_config.OperatorConfig
) -> LeaderLease:
    """The Lease that lets one instance run the autoscaler loop; a crashed holder is replaced
    after three of its intervals (15 s at least)."""
    duration = max(15, math.ceil(3 * cfg.autoscaler_interval_seconds))
    return LeaderLease(client, operator_namespace(namespace), default_identity(), duration)


def ensure_peering(client: k8s_client.ApiClient, namespace: str) -> bool:
    """Create the peering object; False (run standalone, with a warning) without kopf's CRD."""
    kind = "KopfPeering" if namespace else "ClusterKopfPeering"
    meta = {"name": PEERING_NAME, **({"namespace": namespace} if namespace else {})}
    try:
        peering = {"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": meta}
        k8s.apply(client, peering, operator_config.FIELD_MANAGER)
    except ApiException as error:
        if error.status != 404:
            raise
        log.warning(
            "kopf peering CRDs absent; running standalone (see crds/kopf.dev_peerings.yaml)"
        )
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
