"""Scheduler: token budget, max_num_seqs, chunked prefill, preemption newest-first, FCFS, abort."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.runtime.engine.block_manager import BlockManager
from kvpilot.runtime.engine.scheduler import Scheduler, SchedulerOutput
from kvpilot.runtime.engine.sequence import Sequence, SequenceStatus


def make(num_blocks: int, max_seqs: int = 8, budget: int = 64, caching: bool = True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, caching), max_seqs, budget)


def add(sched: Scheduler, request_id: str, length: int, first: int = 0) -> Sequence:
    seq = Sequence(request_id, [first + i for i in range(length)])
    sched.add(seq)
    return seq


def run_step(sched: Scheduler, next_token: int = 1) -> SchedulerOutput:
    """One step as the engine does it: schedule, compute, append sampled tokens."""
    out = sched.schedule()
    sampling = [s.seq for s in out.scheduled if s.is_sampling]
    sched.update_after_step(out)
    for seq in sampling:
        seq.append_token(next_token)
    return out


def planned(out: SchedulerOutput) -> dict[str, int]:
    return {s.seq.request_id: s.num_new_tokens for s in out.scheduled}


@pytest.mark.parametrize(
    ("lengths", "budget", "max_seqs", "expected"),
    [
        ([10, 10, 10], 64, 8, {"0": 10, "1": 10, "2": 10}),  # all fit
        ([50, 50], 64, 8, {"0": 50, "1": 14}),  # second prompt chunked to the budget
        ([10, 10, 10], 64, 2, {"0": 10, "1": 10}),  # max_num_seqs caps admission
        ([100], 32, 8, {"0": 32}),  # a long prompt is chunked
    ],
)
def test_first_step_plan(
    lengths: list[int], budget: int, max_seqs: int, expected: dict[str, int]
) -> None:
    sched = make(64, max_seqs, budget)
    for i, n in enumerate(lengths):
        add(sched, str(i), n, first=i * 1000)
    assert planned(sched.schedule()) == expected


def test_chunked_prefill_keeps_decodes_running() -> None:
    sched = make(64, budget=20)
    add(sched, "a", 5)
    run_step(sched)  # a prefilled, now decoding
    add(sched, "long", 100, first=500)
    for _ in range(3):
        out = run_step(sched)
        assert planned(out)["a"] == 1  # the decode is never stalled by the long prompt
        assert planned(out)["long"] == 19
    assert not [s for s in out.scheduled if s.seq.request_id == "long" and s.is_sampling]


def test_preemption_takes_newest_and_requeues_at_front() -> None:
    sched = make(num_blocks=4, budget=256)
    old = add(sched, "old", 30, first=0)  # 2 blocks
    new = add(sched, "new", 31, first=100)  # 2 blocks: the pool is full
    run_step(sched)
    run_step(sched)  # old grows to 32 tokens computed; needs a 3rd block on the next token
    out = run_step(sched)
    assert [s.request_id for s in out.preempted] == ["new"]
    assert new.status is SequenceStatus.WAITING and new.block_table == []
    assert sched.waiting[0] is new and new.num_computed_tokens == 0
    assert new.num_output_tokens == 2  # generated tokens are kept and recomputed later
    assert old.status is SequenceStatus.RUNNING
    assert sched.num_preemptions == 1


def test_a_lone_sequence_that_cannot_grow_preempts_itself() -> None:
    sched = make(num_blocks=2, budget=256)
    seq = add(sched, "a", 32)
    run_step(sched)
    out = run_step(sched)  # needs a third block, nobody else to preempt
    assert out.preempted == [seq] and out.scheduled == []


def test_waiting_is_first_come_first_served() -> None:
    sched = make(num_blocks=4, budget=256)
    add(sched, "big", 40, first=0)  # 3 blocks
    add(sched, "huge", 40, first=100)  # does not fit beside it
    add(sched, "tiny", 3, first=200)  # would fit, but must not overtake "huge"
    out = run_step(sched)
    assert planned(out) == {"big": 40}


def test_abort_frees_blocks_wherever_the_sequence_is() -> None:
    sched = make(num_blocks=8)
    running = add(sched, "r", 20)
    run_step(sched)
    waiting = add(sched, "w", 20, first=100)
    sched.finish(waiting, "abort")
    sched.finish(running, "abort")
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 8
    assert running.finish_reason == "abort" and running.is_finished


def test_add_rejects_prompt_larger_than_pool() -> None:
    with pytest.raises(ValueError, match="KV blocks"):
        add(make(num_blocks=2), "x", 33)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=12),
    num_blocks=st.integers(4, 16),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 6),
    max_tokens=st.integers(1, 12),
)
def test_every_request_finishes_without_leaks(
    lengths: list[int], num_blocks: int, budget: int, max_seqs: int, max_tokens: int
) -> None:
    """No starvation: whatever the pool and budget, every request completes; no block leaks."""
    sched = make(num_blocks, max_seqs, budget)
    seqs = [add(sched, str(i), n, first=(i % 3) * 100) for i, n in enumerate(lengths)]
    max_len = num_blocks * 16
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        out = run_step(sched)
        assert out.num_batched_tokens <= budget and len(sched.running) <= max_seqs
        for seq in list(sched.running):
            if seq.num_output_tokens >= max_tokens or seq.num_tokens >= max_len:
                sched.finish(seq, "length")
    assert all(s.is_finished for s in seqs)
    assert sched.block_manager.num_free_blocks == num_blocks
