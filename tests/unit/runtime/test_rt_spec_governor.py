"""The speculative-decoding governor: proposals only where their acceptance beats the share of a
step that grows with its rows (kvpilot.runtime.spec_governor)."""

from __future__ import annotations

import pytest

from kvpilot.runtime.spec_governor import PROBE_EVERY, Governor, StepCosts, proposals_pay

FIXED, PER_ROW = 1e-3, 1e-4  # seconds: a step of 32 rows is 76% per-row work


def fed(rows: list[int]) -> StepCosts:
    costs = StepCosts()
    for count in rows:
        costs.add(count, FIXED + PER_ROW * count)
    return costs


def test_the_fit_recovers_fixed_and_per_row_costs() -> None:
    fit = fed([30, 34, 41, 32, 38, 45, 31, 36, 40, 33] * 3).fit()
    assert fit is not None
    assert fit == pytest.approx((FIXED, PER_ROW), rel=1e-6)


@pytest.mark.parametrize(
    ("rows", "why"),
    [([30, 40, 35] * 5, "too few steps"), ([32] * 40, "rows all alike"), ([32, 33] * 20, "barely")],
)
def test_no_fit_while_the_steps_cannot_tell(rows: list[int], why: str) -> None:
    assert fed(rows).fit() is None, why


def test_a_stall_does_not_decide_the_slope() -> None:
    costs = fed([30, 34, 41, 32, 38, 45, 31, 36, 40, 33] * 4)
    costs.add(31, 0.5)  # descheduled for half a second
    fit = costs.fit()
    assert fit is not None and fit[1] < 2 * PER_ROW


def test_the_last_fit_stands_while_the_rows_are_alike() -> None:
    costs = fed([30, 34, 41, 32, 38, 45, 31, 36, 40, 33] * 4)
    fit = costs.fit()
    assert fit is not None
    for _ in range(300):  # proposals off: 32 rows a step, until the spread is forgotten
        costs.add(32, FIXED + PER_ROW * 32)
    assert costs.fit() == fit


@pytest.mark.parametrize(
    ("acceptance", "num_rows", "pays"),
    [
        (0.6, 1, True),  # share 0.09: one sequence gains from nearly any acceptance
        (0.6, 32, False),  # share 0.76
        (0.8, 32, True),
        (0.1, 1, True),
        (0.05, 1, False),
        (0.0, 1, False),
    ],
)
def test_proposals_pay_when_acceptance_beats_the_per_row_share(
    acceptance: float, num_rows: int, pays: bool
) -> None:
    assert proposals_pay(acceptance, (FIXED, PER_ROW), num_rows) is pays


def test_unknown_costs_let_proposals_go_ahead() -> None:
    assert proposals_pay(0.0, None, 32)
    assert proposals_pay(0.0, (FIXED, PER_ROW), 0)


def test_the_governor_follows_recent_acceptance_and_costs() -> None:
    governor = Governor(StepCosts())
    assert governor.acceptance == 1.0 and governor.pays(32)  # nothing known: propose
    governor.on_proposals(4, 0)  # an early miss is too little evidence to stop proposing
    assert governor.acceptance == 0.0 and governor.pays(32)
    for rows in [30, 34, 41, 32, 38, 45, 31, 36, 40, 33] * 4:
        governor.on_step(rows, FIXED + PER_ROW * rows)
        governor.on_proposals(10, 6)
    assert governor.acceptance == pytest.approx(0.6, abs=0.01)
    assert governor.pays(1)
    decisions = [governor.pays(32) for _ in range(2 * PROBE_EVERY)]
    # Not paying: only a probe every PROBE_EVERY steps, to see whether acceptance has changed.
    assert [i for i, d in enumerate(decisions) if d] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1]
    for _ in range(200):  # proposals now kept: the old misses fade
        governor.on_proposals(10, 9)
    assert governor.acceptance == pytest.approx(0.9, abs=0.01) and governor.pays(32)
