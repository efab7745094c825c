"""The speculative-decoding governor: proposals where they have measured faster, the other mode
checked one epoch in a cycle (kvpilot.runtime.spec_governor)."""

from __future__ import annotations

import pytest

from kvpilot.runtime.spec_governor import (
    CYCLE,
    EPOCH,
    LONG_CYCLE,
    SMALL_BATCH,
    Governor,
    Rate,
    choose,
)


@pytest.mark.parametrize(
    ("rate_with", "rate_without", "epoch", "proposes"),
    [
        (None, None, 1, True),  # nothing proposed yet: allowed, nothing to lose
        (None, 5.0, 1, True),
        (5.0, None, 0, True),  # no rate without proposals: alternate epochs
        (5.0, None, 1, False),
        (1.1, 1.0, 0, True),  # close: the faster mode ...
        (1.1, 1.0, CYCLE - 1, False),  # ... and the other in the cycle's last epoch
        (1.1, 1.0, CYCLE, True),
        (1.0, 1.1, 0, False),
        (1.0, 1.1, CYCLE - 1, True),
        (2.0, 1.0, CYCLE - 1, True),  # a clear lead: the other is checked less often
        (2.0, 1.0, LONG_CYCLE - 1, False),
        (1.0, 2.0, LONG_CYCLE - 1, True),
    ],
)
def test_choose_runs_the_faster_mode_and_checks_the_other(
    rate_with: float | None, rate_without: float | None, epoch: int, proposes: bool
) -> None:
    for step in range(epoch * EPOCH, (epoch + 1) * EPOCH):
        assert choose(rate_with, rate_without, step) is proposes


def run(governor: Governor, steps: int, speed_with: float, speed_without: float) -> float:
    """Steps of 32 tokens whose time depends on the mode; the share that proposed."""
    proposing = 0
    for _ in range(steps):
        chosen = governor.pays(32)
        proposing += chosen
        governor.on_step(32, 32 / (speed_with if chosen else speed_without), chosen, 32)
    return proposing / steps


@pytest.mark.parametrize(
    ("speed_with", "speed_without", "low", "high"),
    [
        (0.9, 1.0, 0.0, 1.5 / CYCLE),  # proposals lose 10%: only the checks propose
        (0.5, 1.0, 0.0, 1.5 / LONG_CYCLE + 0.02),  # they lose half: checked seldom
        (1.8, 1.0, 1 - 1.5 / LONG_CYCLE - 0.02, 1.0),  # they win: nearly always
    ],
)
def test_the_governor_settles_on_the_faster_mode(
    speed_with: float, speed_without: float, low: float, high: float
) -> None:
    governor = Governor()
    run(governor, 2 * EPOCH, speed_with, speed_without)  # both measured
    assert low <= run(governor, 40 * CYCLE * EPOCH, speed_with, speed_without) <= high


def test_the_governor_follows_a_change() -> None:
    """A batch that grows (proposals stop paying) and shrinks again (they pay again)."""
    governor = Governor()
    assert run(governor, 50 * EPOCH, 2.0, 1.0) > 0.9
    assert run(governor, 200 * EPOCH, 0.8, 1.0) < 0.2
    # Back: a check epoch finds proposals faster, after the old rate has decayed (a few checks)
    assert run(governor, 200 * EPOCH, 2.0, 1.0) > 0.8


def test_a_small_batch_always_proposes_and_measures_nothing() -> None:
    governor = Governor()
    run(governor, 50 * EPOCH, 0.5, 1.0)  # proposals lose at 32 sequences
    assert not governor.pays(32)
    rates = (governor.with_proposals.per_second, governor.without.per_second)
    assert governor.pays(SMALL_BATCH - 1)
    governor.on_step(1, 10.0, True, SMALL_BATCH - 1)
    assert (governor.with_proposals.per_second, governor.without.per_second) == rates


def test_a_rate_counts_after_a_few_steps() -> None:
    """One rejected proposal's step is no verdict on proposals."""
    rate = Rate()
    rate.add(1, 0.01)
    assert rate.per_second is None
    for _ in range(6):
        rate.add(4, 0.01)
    assert rate.per_second == pytest.approx(25 / 0.07, rel=0.05)
