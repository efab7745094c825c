"""The affinity book: a key's replica is remembered while the key is in use, counted per replica,
and forgotten when idle or when the book is full."""

from __future__ import annotations

from kvpilot.gateway.routing.affinity import Affinity, Placement


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_settled_key_is_found_and_counted() -> None:
    book = Affinity(clock=Clock())
    assert book.placement("a") == Placement(None, {})
    book.settle("a", "r1")
    book.settle("b", "r1")
    book.settle("c", "r2")
    assert book.placement("a") == Placement("r1", {"r1": 2, "r2": 1})


def test_moving_a_key_moves_its_count() -> None:
    book = Affinity(clock=Clock())
    book.settle("a", "r1")
    book.settle("a", "r2")
    assert book.placement("a") == Placement("r2", {"r2": 1})


def test_an_idle_key_is_forgotten_and_a_used_one_kept() -> None:
    clock = Clock()
    book = Affinity(idle_s=10, clock=clock)
    book.settle("old", "r1")
    book.settle("used", "r2")
    clock.now = 8
    book.settle("used", "r2")  # in use again: its idle time starts over
    clock.now = 15
    assert book.placement("old") == Placement(None, {"r2": 1})
    assert book.placement("used").owner == "r2"


def test_the_least_recently_used_key_goes_when_the_book_is_full() -> None:
    book = Affinity(max_keys=2, clock=Clock())
    for key, replica in (("a", "r1"), ("b", "r2"), ("a", "r1"), ("c", "r2")):
        book.settle(key, replica)
    assert book.placement("b") == Placement(None, {"r1": 1, "r2": 1})
