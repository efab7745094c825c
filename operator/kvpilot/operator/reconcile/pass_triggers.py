"""When a ModelDeployment's watch event asks for a full reconcile pass (pure): read from the
object as it is (a spec not yet applied, an autoscaler decision the children do not show), since
kopf may hand over only the latest of a quick series of events.
"""

from __future__ import annotations

from kvpilot.operator.reconcile import typed_status
from kvpilot.operator.reconcile.pass_types import Obj


def spec_unapplied(md: Obj) -> bool:
    """Whether the spec's generation is not the one the last full pass applied
    (`status.observedGeneration`): a new object, or a spec changed since. Only full passes write
    observedGeneration, so this stays true until one has applied the spec."""
    observed = (md.get("status") or {}).get("observedGeneration")
    return observed is None or int(observed) != int(md["metadata"].get("generation", 0))


def needs_full_pass(md: Obj, first_sight: bool) -> bool:
    """Whether a ModelDeployment's watch event asks for a full pass (pure). kopf may hand over
    only the latest of a quick series of events, so this reads the object's state, not what the
    event changed: first seen since the operator started (it may have missed anything), a spec
    not yet applied, or an autoscaler decision the children do not show."""
    return first_sight or spec_unapplied(md) or scale_pending(md)


def scale_pending(md: Obj) -> bool:
    """Whether the builtin autoscaler's last decision in status (its spread per node type, or
    its count) differs from the replicas the last pass applied (status.plan): the one way from
    a scaling decision to the children is a reconcile pass, which the watch runs on this.
    `md` is the object as the watch delivered it: its status is parsed here."""
    if ((md.get("spec") or {}).get("autoscaling") or {}).get("mode", "builtin") != "builtin":
        return False
    status = typed_status.of(md)
    applied = {e.node_type: e.replicas for e in status.plan}
    wanted = status.autoscaling.replicas_per_node_type
    if wanted:
        return any(applied.get(t, 0) != wanted.get(t, 0) for t in {*applied, *wanted})
    desired = status.autoscaling.desired_replicas
    return desired is not None and desired != sum(applied.values())
