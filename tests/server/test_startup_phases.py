"""The start-up's pure parts (server/startup.py): the critical path over overlapping phases, the
process's age from /proc, the log line, and the collector paused for the imports."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from kvpilot.contract.metric_names import STARTUP_PHASES
from kvpilot.runtime.server.startup import (
    StartupClock,
    collector_paused,
    critical_path,
    describe,
    process_age,
)

ALL_AT_ONE_SECOND_APART = {phase: float(i + 1) for i, phase in enumerate(STARTUP_PHASES)}


@pytest.mark.parametrize(
    ("marks", "expected"),
    [
        ({}, {}),
        ({"interpreter": 0.2}, {"interpreter": 0.2}),
        (ALL_AT_ONE_SECOND_APART, dict.fromkeys(STARTUP_PHASES, 1.0)),
        # the model was located while the imports ran: it kept the start waiting for nothing
        (
            {"interpreter": 0.1, "imports": 5.0, "http": 5.2, "model_located": 2.0, "kernel": 5.5},
            {"interpreter": 0.1, "imports": 4.9, "http": 0.2, "model_located": 0.0, "kernel": 0.3},
        ),
        # a fetch longer than the imports: only its tail counts
        (
            {"interpreter": 0.1, "imports": 5.0, "http": 5.0, "model_located": 9.0},
            {"interpreter": 0.1, "imports": 4.9, "http": 0.0, "model_located": 4.0},
        ),
        # a phase not yet done ends the list, even if a later one is marked
        ({"interpreter": 0.1, "model_located": 2.0}, {"interpreter": 0.1}),
    ],
    ids=["none", "one", "in-order", "overlapped", "longer-fetch", "gap"],
)
def test_critical_path(marks: dict[str, float], expected: dict[str, float]) -> None:
    seconds = critical_path(0.0, marks)
    assert seconds == pytest.approx(expected)
    assert list(seconds) == list(expected)  # in the phases' order
    last_done = max((marks[p] for p in seconds), default=0.0)
    assert sum(seconds.values()) == pytest.approx(last_done)  # adds up to the last end


def stat_line(name: str, start_ticks: int) -> str:
    """/proc/<pid>/stat: pid (comm) state, then fields 4..21, starttime as field 22."""
    return f"4242 ({name}) S " + " ".join(["0"] * 18) + f" {start_ticks} 123 456\n"


@pytest.mark.parametrize(
    ("name", "start_ticks", "boot_s", "age"),
    [
        ("python", 1000, 12.5, 2.5),
        ("kvpilot-runtime", 123456, 1234.56, 0.0),
        ("odd) (name", 500, 6.0, 1.0),  # a name with spaces and a parenthesis
        ("python", 1001, 10.0, 0.0),  # a clock read before the tick: never negative
    ],
)
def test_process_age(name: str, start_ticks: int, boot_s: float, age: float) -> None:
    assert process_age(stat_line(name, start_ticks), boot_s, 100) == pytest.approx(age)


def test_the_clock_marks_each_phase_once_and_refuses_unknown_ones() -> None:
    times = iter([1.0, 3.0, 4.0])
    clock = StartupClock(0.5, now=lambda: next(times))
    clock.mark("interpreter")
    clock.mark("imports")
    clock.mark("imports")  # a phase ends once: the first end stays
    assert clock.seconds() == pytest.approx({"interpreter": 0.5, "imports": 2.0})
    with pytest.raises(ValueError, match="unknown start-up phase 'compile'"):
        clock.mark("compile")


def test_describe() -> None:
    line = describe({"interpreter": 0.1, "imports": 6.9, "kernel": 0.004})
    assert line == "7.00 s: interpreter 0.10 s, imports 6.90 s, kernel 0.00 s"


def test_this_process_started_before_its_clock() -> None:
    clock = StartupClock.of_this_process()
    assert clock.started_at < clock.now()


@pytest.fixture
def collector_state() -> Iterator[None]:
    """Whatever a test does to the collector, the session's goes back as it was."""
    was_enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if was_enabled else gc.disable)()


def num_young_collections() -> int:
    return int(gc.get_stats()[0]["collections"])


@pytest.mark.usefixtures("collector_state")
@pytest.mark.parametrize("enabled_before", [True, False], ids=["enabled", "disabled"])
def test_the_collector_is_paused_then_what_was_made_is_frozen(enabled_before: bool) -> None:
    (gc.enable if enabled_before else gc.disable)()
    gc.unfreeze()
    before = num_young_collections()
    with collector_paused():
        assert not gc.isenabled()
        made = [[i] for i in range(10 * gc.get_threshold()[0])]  # ten thresholds' worth
        during = num_young_collections()
    assert during == before  # enabled, it would have collected ten times
    assert gc.isenabled() is enabled_before  # as it was
    assert gc.get_freeze_count() >= len(made)  # the lists made are out of later collections


@pytest.mark.usefixtures("collector_state")
def test_the_collector_comes_back_when_an_import_fails() -> None:
    gc.enable()
    with pytest.raises(ImportError), collector_paused():
        raise ImportError("no module named torch")
    assert gc.isenabled()
