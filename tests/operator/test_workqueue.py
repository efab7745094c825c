"""The work queue's promises: one pass per key at a time, bursts merged, no request lost.

`process` is a recorder that can hold a pass open (an asyncio.Event) so a test can send events
while it runs, the way a rollout's Deployment events arrive during a pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvpilot.operator.reconcile.workqueue import Body, Key, WorkQueue


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool, Any]] = []
        self.times: list[float] = []  # when each pass started, by the loop's clock
        self.running: set[Key] = set()
        self.overlapped = False
        self.hold: asyncio.Event | None = None
        self.started = asyncio.Event()
        self.fail: Exception | None = None

    async def __call__(self, key: Key, full: bool, body: Body | None) -> str:
        self.overlapped |= key in self.running
        self.running.add(key)
        self.calls.append((key[1], full, None if body is None else body["v"]))
        self.times.append(asyncio.get_running_loop().time())
        self.started.set()
        try:
            if self.hold is not None:
                await self.hold.wait()
            await asyncio.sleep(0)
            if self.fail is not None:
                raise self.fail
            return f"{key[1]}#{len(self.calls)}"
        finally:
            self.running.discard(key)


async def until_idle(queue: WorkQueue) -> None:
    async with asyncio.timeout(5):
        while not queue.is_idle():
            await asyncio.sleep(0.01)


def run(
    test: Callable[[WorkQueue, Recorder], Awaitable[None]],
    workers: int = 4,
    status_delay: float = 0.0,
) -> Recorder:
    """Run `test` against a queue with `workers` workers; wait until the queue is idle."""
    recorder = Recorder()

    async def main() -> None:
        queue: WorkQueue = WorkQueue(recorder, status_delay)
        task = asyncio.create_task(queue.run(workers))
        try:
            await test(queue, recorder)
            await until_idle(queue)
        finally:
            task.cancel()
        assert not recorder.overlapped, "two passes of one key overlapped"

    asyncio.run(main())
    return recorder


@pytest.mark.parametrize(
    ("during", "expected"),
    [
        # Three status events while a status pass runs: one more pass, not three.
        ([False, False, False], [("m", False), ("m", False)]),
        # One status event during a pass: its pass starts after the event.
        ([False], [("m", False), ("m", False)]),
        # Status then full during a pass: one more pass, and it is full.
        ([False, True], [("m", False), ("m", True)]),
        # Nothing during the pass: nothing more.
        ([], [("m", False)]),
    ],
)
def test_requests_during_a_pass_run_once_more_after_it(
    during: list[bool], expected: list[tuple[str, bool]]
) -> None:
    async def test(queue: WorkQueue, recorder: Recorder) -> None:
        recorder.hold = asyncio.Event()
        queue.put(("ns", "m"), False)
        await recorder.started.wait()
        for full in during:
            queue.put(("ns", "m"), full)
        recorder.hold.set()

    recorder = run(test)
    assert [(name, full) for name, full, _ in recorder.calls] == expected


def test_queued_requests_merge_into_one_full_pass_with_the_latest_body() -> None:
    async def test(queue: WorkQueue, recorder: Recorder) -> None:
        recorder.hold = asyncio.Event()
        queue.put(("ns", "busy"), False)  # keeps the only worker busy while the others queue
        await recorder.started.wait()
        queue.put(("ns", "m"), True, {"v": 1})
        queue.put(("ns", "m"), False, {"v": 2})
        recorder.hold.set()
        await until_idle(queue)
        assert recorder.calls == [("busy", False, None), ("m", True, 2)]

    run(test, workers=1)


def test_a_request_during_a_pass_brings_its_body_to_the_next_pass() -> None:
    async def test(queue: WorkQueue, recorder: Recorder) -> None:
        recorder.hold = asyncio.Event()
        queue.put(("ns", "m"), False)
        await recorder.started.wait()
        queue.put(("ns", "m"), True, {"v": 7})
        recorder.hold.set()

    recorder = run(test)
    assert recorder.calls == [("m", False, None), ("m", True, 7)]


def test_a_failed_pass_is_logged_and_frees_the_key(caplog: pytest.LogCaptureFixture) -> None:
    async def test(queue: WorkQueue, recorder: Recorder) -> None:
        recorder.fail = RuntimeError("API down")
        queue.put(("ns", "m"), True)
        await until_idle(queue)
        recorder.fail = None
        queue.put(("ns", "m"), False)

    recorder = run(test)
    assert [call[:2] for call in recorder.calls] == [("m", True), ("m", False)]
    assert "pass of ns/m failed: API down" in caplog.text


def test_different_keys_are_passed_at_the_same_time() -> None:
    async def test(queue: WorkQueue, recorder: Recorder) -> None:
        recorder.hold = asyncio.Event()
        for name in ("a", "b", "c"):
            queue.put(("ns", name), True)
        async with asyncio.timeout(5):
            while len(recorder.running) < 3:
                await asyncio.sleep(0.01)
        recorder.hold.set()

    run(test, workers=3)


def test_one_key_is_never_passed_twice_at_once_however_many_ask() -> None:
    async def test(queue: WorkQueue, recorder: Recorder) -> None:
        for i in range(50):
            queue.put(("ns", "m"), i % 2 == 0)
            await asyncio.sleep(0)
        await until_idle(queue)
        # Bursts merge: far fewer passes than requests, and the overlap check in run() holds.
        assert 1 < len(recorder.calls) < 50

    run(test, workers=8)


def test_full_passes_go_before_status_passes_and_an_upgrade_moves_ahead() -> None:
    async def test(queue: WorkQueue, recorder: Recorder) -> None:
        recorder.hold = asyncio.Event()
        queue.put(("ns", "busy"), False)  # keeps the only worker busy while the others queue
        await recorder.started.wait()
        queue.put(("ns", "s1"), False)
        queue.put(("ns", "s2"), False)
        queue.put(("ns", "f1"), True)
        queue.put(("ns", "s2"), True)  # now full: ahead of s1, behind f1
        recorder.hold.set()

    recorder = run(test, workers=1)
    assert [(name, full) for name, full, _ in recorder.calls] == [
        ("busy", False),
        ("f1", True),
        ("s2", True),
        ("s1", False),
    ]


@pytest.mark.parametrize(
    ("requests", "expected", "first_waits"),
    [
        # A rollout's three status events within the delay: one refresh, after the delay.
        ([False, False, False], [("m", False)], True),
        # A full request during the delay goes at once and takes the status request with it.
        ([False, True], [("m", True)], False),
        # A full request is never delayed; a status one after it waits for it, then its delay.
        ([True, False], [("m", True), ("m", False)], False),
    ],
)
def test_status_requests_wait_the_delay_and_merge_while_they_wait(
    requests: list[bool], expected: list[tuple[str, bool]], first_waits: bool
) -> None:
    delay = 0.3
    start: list[float] = []

    async def test(queue: WorkQueue, recorder: Recorder) -> None:
        start.append(asyncio.get_running_loop().time())
        for full in requests:
            queue.put(("ns", "m"), full)
            await asyncio.sleep(0.01)

    recorder = run(test, status_delay=delay)
    assert [(name, full) for name, full, _ in recorder.calls] == expected
    assert (recorder.times[0] - start[0] >= delay) == first_waits
