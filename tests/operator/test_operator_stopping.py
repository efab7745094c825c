"""SIGTERM before kopf's own handlers: a standby's wait wakes at once, and kopf's stop flag is set
whether its loop runs yet or not (cli.Stopping)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from kvpilot.operator import lease
from kvpilot.operator.cli import Stopping


@pytest.fixture
def stopping() -> Iterator[Stopping]:
    stopping = Stopping()
    before = signal.signal(signal.SIGTERM, stopping.on_signal)
    try:
        yield stopping
    finally:
        signal.signal(signal.SIGTERM, before)


class NeverHeld(lease.LeaderLease):
    """Another instance holds the Lease for as long as the test runs."""

    def hold(self) -> bool:
        self.holder = "the-other"
        return False


def test_sigterm_wakes_a_waiting_standby_at_once(stopping: Stopping) -> None:
    standby = NeverHeld(client=None, namespace="default", identity="me", duration_s=15)  # type: ignore[arg-type]
    standby.retry_s = 600.0  # without the wake-up, the wait would outlast the test's timeout
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        started = time.monotonic()
        assert standby.wait_until_held(stop=stopping.asked) is False
        assert time.monotonic() - started < 60
    finally:  # never a SIGTERM after the fixture has put the default action back
        timer.cancel()
        timer.join()
    assert stopping.flag.is_set() and not stopping.lost


def test_sigterm_before_kopfs_loop_leaves_the_flag_set_for_it(stopping: Stopping) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    assert stopping.asked.is_set() and stopping.flag.is_set()

    async def kopf_waits() -> None:  # as kopf's stop-flag checker does, on its own loop
        await asyncio.wait_for(stopping.flag.wait(), timeout=5)

    asyncio.run(kopf_waits())


def test_sigterm_while_kopfs_loop_runs_sets_the_flag_on_that_loop(stopping: Stopping) -> None:
    async def signalled_mid_loop() -> None:
        waiter = asyncio.create_task(stopping.flag.wait())
        await asyncio.sleep(0)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs on this thread, mid-loop
        await asyncio.wait_for(waiter, timeout=5)

    asyncio.run(signalled_mid_loop())
    assert stopping.asked.is_set() and not stopping.lost


def test_a_lost_lease_stops_kopf_and_says_so() -> None:
    stopping = Stopping()
    stopping.lease_lost()
    assert stopping.flag.is_set() and stopping.lost and not stopping.asked.is_set()
