"""The operator's work on kopf's event loop: handlers ask for passes, one queue runs them.

Handlers (all async, on kopf's loop) only say which ModelDeployment needs which pass; the work
queue (reconcile/workqueue.py) keeps one pass per object at a time and merges bursts, and a pool of
threads runs the pass itself (`Controller.run_pass`), since the Kubernetes client blocks. The
node and pod indexes are read here, on the loop kopf updates them on, and handed to the thread
as lists. The re-planner and the autoscaler loop are tasks on the same loop.

A full pass that fails (the API answered an error, a source could not be read) is tried again
after a delay that doubles per failure up to `MAX_BACKOFF_SECONDS`, as controller-runtime's
rate-limited queue does: no watch event may come to ask again. A spec that cannot work is not
retried; its status says why, and the next spec change asks again.

Nothing here needs to survive a restart: kopf's first listing passes every object again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpilot.contract import k8s
from kvpilot.operator import observability
from kvpilot.operator.planning import inventory
from kvpilot.operator.reconcile import desired_state
from kvpilot.operator.reconcile.controller import Applied, Controller
from kvpilot.operator.reconcile.workqueue import Body, Key, WorkQueue

# Passes in flight at once. A pass mostly waits on the API, and under a burst each of its writes
# waits long (`python -m bench.operator_scale` with WORKERS set to each value, 200 creates on 2
# cores: create -> Deployment p95 11.7 s with 16, 7.9 s with 48, 2.3 s with 128, 1.2 s with 256),
# so the burst is best passed all at once. An idle thread costs little; the pool makes them only
# as passes need them.
WORKERS = 256
# A status-only pass (a child Deployment's status moved) waits this long, merging the rest of
# the rollout's events, so one rollout costs about one refresh (a GET, a LIST, a status patch),
# not one per event; in a burst of creates those refreshes were most of the operator's API calls
# and competed with the creates' full passes. Ready shows up to this much later.
STATUS_DELAY_SECONDS = 1.0
# A new object's finishing pass (its Service, status and Planned event; reconcile/controller.py says
# why its Deployments go first) waits until no other new object's first pass has come for
# FINISH_QUIET_SECONDS, so that in a burst of creates the apiserver serves the Deployments of the
# creates still coming before the rest; and at most FINISH_LATEST_SECONDS, for a burst that goes
# on. A fixed 1 s after each first pass left the burst's p95 at 0.86 s: the finishing passes of
# its start met the first passes of its end (`python -m bench.operator_scale`).
FINISH_QUIET_SECONDS = 0.5
FINISH_LATEST_SECONDS = 5.0
MAX_BACKOFF_SECONDS = 60.0
log = logging.getLogger(__name__)


def backoff_s(failures: int) -> float:
    """Seconds before the next try after `failures` failed passes in a row: 1, 2, 4, ... 60."""
    return min(MAX_BACKOFF_SECONDS, 2.0 ** (failures - 1))


def index_values(index: Mapping[Any, Iterable[Any]]) -> list[Any]:
    """Every value in a kopf index (read on kopf's loop, where it cannot change meanwhile)."""
    return [value for store in index.values() for value in store]


class PassScheduler:
    """Passes of ModelDeployments, asked for by handlers and run by the work queue."""

    def __init__(
        self,
        controller: Controller,
        nodes: Mapping[Any, Iterable[Any]],
        pods: Mapping[Any, Iterable[Any]],
        mds: Mapping[Any, Iterable[Any]],
        workers: int = WORKERS,
    ) -> None:
        self.controller, self.nodes, self.pods, self.mds = controller, nodes, pods, mds
        self.workers = workers
        self.queue = WorkQueue(self._run, STATUS_DELAY_SECONDS)
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="kvpilot-pass")
        # Inventory fingerprint each object was last planned with: decides whether a node change
        # is worth a pass. A cache: a restart empties it, and every object passes once anyway.
        self.planned_with: dict[Key, Any] = {}
        self.seen: dict[Key, tuple[Any, ...]] = {}  # child Deployments' last reported facts
        self.inventory_known = False  # a node event came: the indexes follow the cluster
        self.failures: dict[Key, int] = {}  # failed full passes in a row, for the backoff
        self.sighted: set[Key] = set()  # ModelDeployments seen since the start
        # New objects whose first pass applied their Deployments and whose finishing pass has
        # not run yet: what that first pass applied, handed to the next pass of the object.
        self.unfinished: dict[Key, Applied] = {}
        self.finish_asked: set[Key] = set()  # of those, the ones whose finishing pass is queued
        self.finish_timer: asyncio.TimerHandle | None = None
        self.oldest_unfinished: float | None = None  # on the loop's clock

    async def run(self) -> None:
        try:
            await self.queue.run(self.workers)
        finally:
            self.executor.shutdown(wait=False, cancel_futures=True)

    def inventory(self) -> tuple[list[Any], list[Any]]:
        """Nodes and GPU pods, trimmed, as the watch indexes hold them now."""
        return index_values(self.nodes), index_values(self.pods)

    def model_deployments(self) -> list[Any]:
        """Every ModelDeployment's name and spec, as the watch index holds them now."""
        return index_values(self.mds)

    def known_inventory(self) -> tuple[list[Any], list[Any]] | None:
        """The indexes once they follow the cluster (None before: a standby's watches are
        paused, and its indexes stay empty)."""
        return self.inventory() if self.inventory_known else None

    async def _run(self, key: Key, full: bool, body: Body | None) -> desired_state.Desired | None:
        if not full and key in self.unfinished:
            # A new object's Deployment reporting progress: its finishing pass, due soon, reports
            # the Deployments as they are then. Run now, this pass would finish the object amid
            # the burst (a spec not applied yet makes any pass full).
            return None
        nodes, pods = self.inventory()
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            desired = await loop.run_in_executor(
                self.executor,
                self.controller.run_pass,
                *key,
                nodes,
                pods,
                full,
                body,
                self.unfinished.get(key),
            )
        except k8s.ApiException as error:
            if error.status == 404:  # the object or its namespace went away mid-pass
                log.info("%s/%s is gone; pass dropped", *key)
                self.forget(key)
                return None
            observability.record_reconcile(time.monotonic() - started, "error")
            self.retry_later(key, full, f"API error {error.status} {error.reason}")
            return None
        except Exception as error:  # a bug must not end the object's passes for good
            log.exception("pass of %s/%s failed", *key)
            observability.record_reconcile(time.monotonic() - started, "error")
            self.retry_later(key, full, f"{type(error).__name__}: {error}")
            return None
        invalid = desired is not None and desired.is_invalid_spec
        outcome = "invalid" if invalid else "success"
        observability.record_reconcile(time.monotonic() - started, outcome)
        self.record(key, full, nodes, desired)
        return desired

    def record(
        self, key: Key, full: bool, nodes: list[Any], desired: desired_state.Desired | None
    ) -> None:
        """What a finished pass leaves for the next: its inventory, and a retry if it asks."""
        if desired is None:
            self.forget(key)
            return
        if desired.applied_first is not None:  # the Deployments only: finish soon
            self.unfinished[key] = desired.applied_first
            self.finish_soon()
            return
        self.unfinished.pop(key, None)
        self.finish_asked.discard(key)
        if full:
            self.planned_with[key] = inventory.fingerprint(nodes)
        if desired.needs_retry:
            why = desired.error or "the eval set could not be read (QualityMeasured)"
            self.retry_later(key, True, why)
            return
        self.failures.pop(key, None)
        if full and desired.is_invalid_spec:
            log.warning("%s/%s: %s; not retried until the spec changes", *key, desired.error)

    def finish_soon(self) -> None:
        """(Re)set the time of the finishing passes: FINISH_QUIET_SECONDS from now, at the
        latest FINISH_LATEST_SECONDS after the oldest first pass waiting for one."""
        loop = asyncio.get_running_loop()
        if self.finish_timer is not None:
            self.finish_timer.cancel()
        now = loop.time()
        oldest = self.oldest_unfinished = self.oldest_unfinished or now
        at = min(now + FINISH_QUIET_SECONDS, oldest + FINISH_LATEST_SECONDS)
        self.finish_timer = loop.call_at(at, self.finish)

    def finish(self) -> None:
        """The finishing pass of each new object waiting for one, once: not of those another
        pass finished meanwhile (a child's event passes in full an object whose spec no pass
        has applied yet), nor again of those whose finishing pass is queued or running."""
        self.finish_timer = self.oldest_unfinished = None
        for key in self.unfinished.keys() - self.finish_asked:
            self.finish_asked.add(key)
            self.queue.put(key, True)

    def retry_later(self, key: Key, full: bool, why: str) -> None:
        """Pass `key` again after a delay that doubles with each failure in a row."""
        failures = self.failures[key] = self.failures.get(key, 0) + 1
        delay = backoff_s(failures)
        log.warning("pass of %s/%s failed (%s); retrying in %.0f s", *key, why, delay)
        asyncio.get_running_loop().call_later(delay, self.queue.put, key, full)

    def first_sight(self, key: Key) -> bool:
        """Whether this is the first event of `key` since the operator started (it may have
        missed changes while down: the object passes in full once). Not kopf's event type None:
        kopf lists again, with type None, each time its watch reconnects."""
        first = key not in self.sighted
        self.sighted.add(key)
        return first

    def forget(self, key: Key) -> None:
        """The object is gone: drop what was kept for it."""
        self.planned_with.pop(key, None)
        self.failures.pop(key, None)
        self.sighted.discard(key)
        self.unfinished.pop(key, None)
        self.finish_asked.discard(key)

    def needs_replan(self, key: Key, nodes: Iterable[Any]) -> bool:
        return self.planned_with.get(key) != inventory.fingerprint(nodes)

    def is_news(self, deployment: Body, deleted: bool = False) -> bool:
        """Whether a child Deployment's event changes anything the status reports.

        Most of a rollout's events only touch conditions and timestamps; skipping them keeps a
        burst of 200 new ModelDeployments from drowning in status refreshes. The cache is lost on
        restart, which costs one refresh per Deployment, nothing more.
        """
        meta, status = deployment["metadata"], deployment.get("status") or {}
        key = (meta["namespace"], meta["name"])
        if deleted:
            self.seen.pop(key, None)
            return True
        facts = (
            meta.get("generation"),
            (deployment.get("spec") or {}).get("replicas"),
            *(
                status.get(k)
                for k in ("observedGeneration", "replicas", "updatedReplicas", "readyReplicas")
            ),
        )
        is_new = self.seen.get(key) != facts
        self.seen[key] = facts
        return is_new


class Replanner:
    """Re-plans every ModelDeployment planned with another node inventory, once nodes settle.

    Node events arrive in bursts (a pool of 50 nodes joins, heartbeats); a pass per event would be
    wasted work, so `notice` only records a change and the task acts once none has come for
    `DEBOUNCE_SECONDS`.
    """

    DEBOUNCE_SECONDS = 1.0

    def __init__(self, pass_scheduler: PassScheduler) -> None:
        self.pass_scheduler = pass_scheduler
        self.fingerprint: Any = None
        self.changed = asyncio.Event()

    def notice(self) -> None:
        """A node event came; called on kopf's loop after the index has taken it."""
        self.pass_scheduler.inventory_known = True
        fingerprint = inventory.fingerprint(index_values(self.pass_scheduler.nodes))
        if fingerprint != self.fingerprint:
            # The first fingerprint after a start is the baseline: first sights plan with it.
            if self.fingerprint is not None:
                self.changed.set()
            self.fingerprint = fingerprint

    async def run(self) -> None:
        while True:
            await self.changed.wait()
            await self._settle()
            self.replan_all()

    async def _settle(self) -> None:
        """Return once no change has come for DEBOUNCE_SECONDS."""
        while self.changed.is_set():
            self.changed.clear()
            try:
                async with asyncio.timeout(self.DEBOUNCE_SECONDS):
                    await self.changed.wait()
            except TimeoutError:
                return

    def replan_all(self) -> None:
        pass_scheduler = self.pass_scheduler
        nodes = index_values(pass_scheduler.nodes)
        for md in pass_scheduler.model_deployments():
            key = (md["metadata"]["namespace"], md["metadata"]["name"])
            if pass_scheduler.needs_replan(key, nodes):
                log.info("node inventory changed: re-planning %s/%s", *key)
                pass_scheduler.queue.put(key, full=True)
