"""How many pods hold each adapter, and which, from each adapter's demand: tables
(adapters/assignment.py)."""

from __future__ import annotations

import pytest

from kvpilot.operator.adapters import assignment


@pytest.mark.parametrize(
    ("share", "num_pods", "expected"),
    [
        (0.0, 4, 1),  # never asked for: still on one pod
        (0.1, 4, 1),
        (0.125, 4, 1),  # exactly one copy's worth (0.125 x 4 x 2 = 1.0, no float drift)
        (0.2, 4, 2),
        (0.3, 4, 3),
        (0.5, 4, 4),  # half the traffic: every pod
        (1.0, 4, 4),
        (0.3, 1, 1),
    ],
)
def test_copies_for(share: float, num_pods: int, expected: int) -> None:
    assert assignment.copies_for(share, num_pods) == expected


@pytest.mark.parametrize(
    ("share", "current", "expected"),
    [
        (0.1, 0, 1),  # a new adapter
        (0.2, 1, 2),  # demand rose: copies added at once
        (0.2, 3, 3),  # within the band (0.2 x 1.5 needs 3): stays
        (0.2, 4, 3),  # past the band: down to what 1.5 x the share needs
        (0.1, 2, 2),  # 0.15 needs 2: stays
        (0.05, 2, 1),  # 0.075 needs 1: one copy goes
    ],
)
def test_num_copies_has_hysteresis(share: float, current: int, expected: int) -> None:
    assert assignment.num_copies(share, 4, current) == expected


SHARE = {"h": 0.6, "m": 0.3, "c": 0.1}


@pytest.mark.parametrize(
    ("copies", "capacity", "expected"),
    [
        ({"h": 4, "m": 2, "c": 1}, 8, {"h": 4, "m": 2, "c": 1}),  # fits
        ({"h": 4, "m": 2, "c": 1}, 6, {"h": 3, "m": 2, "c": 1}),  # h's 4th copy loses least
        ({"h": 4, "m": 2, "c": 1}, 3, {"h": 1, "m": 1, "c": 1}),
        ({"h": 1, "m": 1, "c": 1}, 2, {"h": 1, "m": 1, "c": 1}),  # never below one each
    ],
)
def test_fit_slots(copies: dict[str, int], capacity: int, expected: dict[str, int]) -> None:
    assert assignment.fit_slots(copies, SHARE, capacity) == expected


PODS4 = ["p0", "p1", "p2", "p3"]
HOT_AND_COLD = {"hot": 60.0, "c1": 10.0, "c2": 10.0, "c3": 10.0, "c4": 10.0}
SPREAD_PLAN = {
    "p0": {"hot", "c1"},
    "p1": {"hot", "c2"},
    "p2": {"hot", "c3"},
    "p3": {"hot", "c4"},
}


def empty(pods: list[str]) -> dict[str, set[str]]:
    return {pod: set() for pod in pods}


@pytest.mark.parametrize(
    ("adapters", "demand", "held", "slots", "expected"),
    [
        ([], {}, {}, 4, {}),
        (["a"], {}, {}, 4, {}),  # no ready pod: nothing to place
        (  # before any traffic: equally hot, one copy each, spread evenly
            [f"a{i:02}" for i in range(8)],
            {},
            empty(PODS4),
            4,
            {f"p{p}": {f"a{p:02}", f"a{p + 4:02}"} for p in range(4)},
        ),
        (  # before any traffic, few adapters: each on every pod
            ["a", "b"],
            {},
            empty(PODS4),
            4,
            {pod: {"a", "b"} for pod in PODS4},
        ),
        # hot on every pod, cold ones one each on the pods with the least demand
        (list(HOT_AND_COLD), HOT_AND_COLD, empty(PODS4), 4, SPREAD_PLAN),
        (  # demand moved a little: nothing moves
            list(HOT_AND_COLD),
            {**HOT_AND_COLD, "c1": 12.0},
            SPREAD_PLAN,
            4,
            SPREAD_PLAN,
        ),
        (  # a cold adapter stays where it is, though another pod has less demand
            list(HOT_AND_COLD),
            HOT_AND_COLD,
            {"p0": {"hot", "c1", "c2"}, "p1": {"hot"}, "p2": {"hot", "c3"}, "p3": {"hot", "c4"}},
            4,
            {"p0": {"hot", "c1", "c2"}, "p1": {"hot"}, "p2": {"hot", "c3"}, "p3": {"hot", "c4"}},
        ),
        (  # more adapters than slots: each keeps one copy, spread evenly past the slots
            list("abcdef"),
            {},
            empty(["p0", "p1"]),
            2,
            {"p0": {"a", "c", "e"}, "p1": {"b", "d", "f"}},
        ),
        (  # the slots cut the hot adapter's copies before a cold one's only copy
            ["h", "c"],
            {"h": 90.0, "c": 10.0},
            empty(["p0", "p1"]),
            1,
            {"p0": {"h"}, "p1": {"c"}},
        ),
        (  # h fell to a fifth of the traffic: past the band, one of its 4 copies goes
            ["x", "h"],
            {"x": 80.0, "h": 20.0},
            {pod: {"x", "h"} for pod in PODS4},
            4,
            {"p0": {"x", "h"}, "p1": {"x", "h"}, "p2": {"x", "h"}, "p3": {"x"}},
        ),
        (  # a new pod takes the copies an adapter lacks; one the spec dropped is not planned
            ["a"],
            {"a": 5.0},
            {"p0": {"a", "gone"}, "p1": set()},
            4,
            {"p0": {"a"}, "p1": {"a"}},
        ),
    ],
)
def test_plan(
    adapters: list[str],
    demand: dict[str, float],
    held: dict[str, set[str]],
    slots: int,
    expected: dict[str, set[str]],
) -> None:
    assert assignment.plan(adapters, demand, held, slots) == expected


def test_plan_is_stable_across_syncs() -> None:
    """Planned, carried out, planned again from where the adapters now are: nothing moves."""
    demand = {f"a{i:02}": 100.0 / (i + 1) for i in range(16)}  # Zipf
    held = empty(PODS4)
    first = assignment.plan(list(demand), demand, held, 6)
    again = assignment.plan(list(demand), demand, first, 6)
    assert again == first
    copies = {name: sum(name in first[p] for p in PODS4) for name in demand}
    assert (copies["a00"], copies["a01"], copies["a15"]) == (3, 2, 1)  # 30%, 15%, 2% of it
    assert all(len(first[p]) <= 6 for p in PODS4)
