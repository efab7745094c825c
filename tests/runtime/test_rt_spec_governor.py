"""The speculative-decoding governor: proposals where they have measured faster, the other mode
checked one epoch in a cycle (kvpilot.runtime.engine.spec_governor)."""

from __future__ import annotations

import pytest

from kvpilot.runtime.engine.spec_governor import (
    CHECK_COST,
    CYCLE,
    EPOCH,
    LONG_CYCLE,
    SMALL_BATCH,
    Governor,
    Rate,
    choose,
    cycle_epochs,
)


@pytest.mark.parametrize(
    ("rate_with", "rate_without", "epoch", "proposes"),
    [
        (None, None, 1, True),  # nothing proposed yet: allowed, nothing to lose
        (None, 5.0, 1, True),
        (5.0, None, 0, True),  # no rate without proposals: alternate epochs
        (5.0, None, 1, False),
        (1.02, 1.0, 0, True),  # close: the faster mode ...
        (1.02, 1.0, CYCLE - 1, False),  # ... and the other in the cycle's last epoch
        (1.02, 1.0, CYCLE, True),
        (1.0, 1.02, 0, False),
        (1.0, 1.02, CYCLE - 1, True),
        (1.1, 1.0, CYCLE - 1, True),  # a wider lead: the other is checked less often
        (1.1, 1.0, 18, True),
        (1.1, 1.0, 19, False),  # a tenth of an epoch more, over 20 epochs: 0.5%
        (2.0, 1.0, CYCLE - 1, True),  # a clear lead: checked seldom
        (2.0, 1.0, LONG_CYCLE - 1, False),
        (1.0, 2.0, LONG_CYCLE - 1, True),
    ],
)
def test_choose_runs_the_faster_mode_and_checks_the_other(
    rate_with: float | None, rate_without: float | None, epoch: int, proposes: bool
) -> None:
    for step in range(epoch * EPOCH, (epoch + 1) * EPOCH):
        assert choose(rate_with, rate_without, step) is proposes


@pytest.mark.parametrize(
    ("lead", "epochs"),
    [
        (1.0, CYCLE),  # a tie: checks cost nothing
        (1.04, CYCLE),  # 0.04 x 199 = 7.96: the shortest cycle
        (1.05, 10),  # 9.95
        (1.1, 20),  # 19.9
        (1.18, 36),  # 35.8 (proposals at 0.85x: tiny-llama at 32)
        (1.5, 100),  # 99.5
        (2.0, LONG_CYCLE),  # 199: the longest cycle
        (3.0, LONG_CYCLE),
    ],
)
def test_the_cycle_keeps_the_cost_of_checking_small(lead: float, epochs: int) -> None:
    assert cycle_epochs(lead) == epochs
    if CYCLE < epochs < LONG_CYCLE:  # the check epoch's extra time over the cycle's: the budget
        extra = lead - 1
        assert extra / (epochs + extra) <= CHECK_COST < extra / (epochs - 1 + extra)


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
    assert low <= run(governor, 4 * LONG_CYCLE * EPOCH, speed_with, speed_without) <= high


@pytest.mark.parametrize(("speed_with", "speed_without"), [(0.85, 1.0), (0.95, 1.0), (1.0, 0.9)])
def test_checking_costs_at_most_its_budget(speed_with: float, speed_without: float) -> None:
    """Settled, the throughput is the faster mode's less at most CHECK_COST (plus the rounding
    of the cycle to whole epochs)."""
    governor = Governor()
    run(governor, 2 * EPOCH, speed_with, speed_without)
    share = run(governor, 40 * LONG_CYCLE * EPOCH, speed_with, speed_without)
    slower_share = share if speed_with < speed_without else 1 - share
    seconds = slower_share / min(speed_with, speed_without) + (1 - slower_share) / max(
        speed_with, speed_without
    )
    loss = 1 - 1 / seconds / max(speed_with, speed_without)
    assert 0 < loss <= CHECK_COST * 1.1


def test_the_governor_follows_a_change() -> None:
    """A batch that grows (proposals stop paying) and shrinks again (they pay again): each time
    one cycle at most, and one check of the other mode, is enough to switch."""
    governor = Governor()
    assert run(governor, 50 * EPOCH, 2.0, 1.0) > 0.9
    run(governor, (LONG_CYCLE + 1) * EPOCH, 0.8, 1.0)
    assert run(governor, 10 * EPOCH, 0.8, 1.0) <= 0.1
    # Proposals measured at 0.8: checked every cycle_epochs(1.25) epochs, and the first check
    # after the change outweighs what the mode measured before it
    run(governor, (cycle_epochs(1 / 0.8) + 1) * EPOCH, 2.0, 1.0)
    assert run(governor, 10 * EPOCH, 2.0, 1.0) >= 0.9


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


def test_a_check_after_a_long_cycle_reads_the_mode_as_it_is_now() -> None:
    """Aged by the other mode's steps, the old measurements keep their rate but weigh little
    against one check epoch's."""
    rate = Rate()
    for _ in range(50):
        rate.add(32, 40.0)  # 0.8 tokens a second
    for _ in range(LONG_CYCLE * EPOCH):
        rate.age()
    assert rate.per_second == pytest.approx(0.8)
    for _ in range(EPOCH):
        rate.add(32, 16.0)  # 2.0 now
    assert rate.per_second is not None and rate.per_second > 1.9
