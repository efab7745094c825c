"""A request's priority (vLLM's `priority` field: an int64, lower runs first) as metrics label it.

The runtime (per-priority TTFT and queue time) and the gateway (its fair queue's series) label
priorities alike, so one dashboard joins them: the value itself from -9 to 9 (what a gateway's few
bands or a client's levels use), the rest in two open-ended labels. Any int64 is a valid priority,
and a label per value would let clients create series without bound.
"""

from __future__ import annotations

MAX_LABELLED = 9


def label(priority: int) -> str:
    """The bounded label of a request priority: 21 values at most."""
    if priority > MAX_LABELLED:
        return f">={MAX_LABELLED + 1}"
    if priority < -MAX_LABELLED:
        return f"<=-{MAX_LABELLED + 1}"
    return str(priority)
