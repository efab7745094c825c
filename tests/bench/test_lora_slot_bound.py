"""bench.lora_slot_bound's closed-loop model: rows and slot loads per step, by hand."""

from __future__ import annotations

import pytest

from bench.engine_lora import NUM_ZIPF
from bench.lora_slot_bound import (
    Choose,
    InFlight,
    held_slots,
    held_slots_by_demand,
    pause_most_running,
    pause_round_robin,
    run_loop,
    tail_share,
)


@pytest.mark.parametrize(
    ("names", "choose", "concurrency", "expected"),
    [
        # one adapter: every sequence runs every step, loaded once
        (["a"] * 4, held_slots(1), 4, (4.0, 0.5)),
        # one slot, two adapters: b waits until a's sequence is done with the slot
        (["a", "b"], held_slots(1), 2, (1.0, 0.5)),
        (["a", "b"], held_slots(2), 2, (2.0, 1.0)),
        # round robin swaps the one slot every step: same rows, a load each step
        (["a", "b"], pause_round_robin(1), 2, (1.0, 1.0)),
        # most running first: a's two sequences go before b's one
        (["a", "a", "b"], pause_most_running(1, 10**9), 3, (1.5, 0.5)),
    ],
)
def test_rows_and_loads_per_step(
    names: list[str], choose: Choose, concurrency: int, expected: tuple[float, float]
) -> None:
    assert run_loop(names, choose, concurrency, output_tokens=2) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("max_pause", "expected_loads"),
    [
        (10**9, 0.25),  # no bound: b waits out a's 4 steps, 2 loads in 8 steps
        (1, 1.0),  # b left out for more than a step goes first: the slot swaps every step
    ],
)
def test_an_adapter_paused_past_its_bound_goes_first(max_pause: int, expected_loads: float) -> None:
    rows, loads = run_loop(["a", "a", "b"], pause_most_running(1, max_pause), 3, output_tokens=4)
    assert (rows, loads) == pytest.approx((1.5, expected_loads))


@pytest.mark.parametrize(("max_loras", "expected"), [(0, 1.0), (NUM_ZIPF, 0.0)])
def test_tail_share_ends(max_loras: int, expected: float) -> None:
    assert tail_share(max_loras) == pytest.approx(expected, abs=1e-12)


def _seq(adapter: str, arrived: int) -> InFlight:
    return InFlight(adapter, num_left=2, arrived=arrived, last_run=arrived)


@pytest.mark.parametrize(
    ("flight", "resident", "step", "expected"),
    [
        # the free slot goes to the adapter with the most waiting, not the first in the queue
        ([_seq("a", 0), _seq("b", 1), _seq("b", 2)], [], 5, ["b"]),
        # among equals, the longest waiting
        ([_seq("b", 3), _seq("a", 1)], [], 5, ["a"]),
        # a slot held by a sequence in flight stays: no free slot, nothing loads
        ([_seq("a", 0), _seq("b", 1), _seq("b", 2)], ["a"], 5, ["a"]),
        # aging: a has waited 64 steps, it goes before b's two
        ([_seq("a", 0), _seq("b", 10), _seq("b", 11)], [], 64, ["a"]),
        ([_seq("a", 1), _seq("b", 10), _seq("b", 11)], [], 64, ["b"]),
    ],
)
def test_demand_order_fills_free_slots_with_the_most_waiting_adapter_oldest_past_the_bound(
    flight: list[InFlight], resident: list[str], step: int, expected: list[str]
) -> None:
    assert held_slots_by_demand(1, 64)(flight, resident, step) == expected
