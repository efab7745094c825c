"""Scheduler: token budget, max_num_seqs, chunked prefill, preemption newest-first, FCFS, abort;
under --scheduling-policy priority: (priority, arrival) order, preemption for a better request."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.runtime.engine.block_manager import BlockManager
from kvpilot.runtime.engine.lora_policy import (
    MAX_LORA_WAIT_STEPS,
    AdapterDemand,
    SlotPlan,
    plan_slots,
)
from kvpilot.runtime.engine.lora_slots import LoraRequest, LoraSlots
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.scheduler import Scheduler, SchedulerOutput
from kvpilot.runtime.engine.sequence import Sequence, SequenceStatus
from kvpilot.runtime.engine.waiting_queue import make_waiting_queue


def make(
    num_blocks: int,
    max_seqs: int = 8,
    budget: int = 64,
    caching: bool = True,
    policy: str = "fcfs",
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, caching), max_seqs, budget, policy=policy)


def add(
    sched: Scheduler, request_id: str, length: int, first: int = 0, priority: int = 0
) -> Sequence:
    params = SamplingParams(priority=priority)
    seq = Sequence(request_id, [first + i for i in range(length)], params)
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
    assert sched.waiting.peek() is new and new.num_computed_tokens == 0
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
    priorities=st.none() | st.lists(st.integers(-2, 2), min_size=12, max_size=12),
)
def test_every_request_finishes_without_leaks(
    lengths: list[int],
    num_blocks: int,
    budget: int,
    max_seqs: int,
    max_tokens: int,
    priorities: list[int] | None,
) -> None:
    """No starvation and no livelock: whatever the pool, budget and priorities (None: fcfs),
    every request completes; no block leaks."""
    policy = "fcfs" if priorities is None else "priority"
    sched = make(num_blocks, max_seqs, budget, policy=policy)
    seqs = [
        add(sched, str(i), n, first=(i % 3) * 100, priority=(priorities or [0] * 12)[i])
        for i, n in enumerate(lengths)
    ]
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


# ---- --scheduling-policy priority -----------------------------------------------------------


def queued(priority: int) -> Sequence:
    return Sequence("q", [1, 2, 3], SamplingParams(priority=priority))


@pytest.mark.parametrize(
    ("policy", "pushes", "expected"),
    [
        # (priority, at_front) in arrival order -> the order they leave in (arrival indices)
        ("fcfs", [(0, False), (0, False), (0, False)], [0, 1, 2]),
        ("fcfs", [(0, False), (0, False), (0, True)], [2, 0, 1]),  # a preempted one: front
        ("priority", [(5, False), (0, False), (3, False)], [1, 2, 0]),  # lower value first
        ("priority", [(1, False), (-1, False), (1, False)], [1, 0, 2]),  # arrival among equals
        ("priority", [(0, False), (1, False), (1, True)], [0, 1, 2]),  # rank, not at_front
    ],
)
def test_waiting_queue_order(
    policy: str, pushes: list[tuple[int, bool]], expected: list[int]
) -> None:
    queue = make_waiting_queue(policy)
    seqs = [queued(priority) for priority, _ in pushes]
    for seq, (_, at_front) in zip(seqs, pushes, strict=True):
        queue.push(seq, at_front)
    assert [seqs.index(queue.pop()) for _ in seqs] == expected


def test_priority_queue_keeps_a_preempted_sequence_in_its_place() -> None:
    """Requeued with its own arrival, it goes ahead of later requests of its priority."""
    queue = make_waiting_queue("priority")
    first, later, better = queued(1), queued(1), queued(0)
    queue.push(later)
    queue.push(better)
    queue.push(first, at_front=True)  # preempted: arrived before `later`
    assert [queue.pop() for _ in range(3)] == [better, first, later]


def test_priority_queue_remove() -> None:
    queue = make_waiting_queue("priority")
    seqs = [queued(p) for p in (2, 0, 1)]
    for seq in seqs:
        queue.push(seq)
    queue.remove(seqs[1])
    assert len(queue) == 2 and seqs[1] not in queue
    assert [queue.pop() for _ in range(2)] == [seqs[2], seqs[0]]


def test_waiting_are_admitted_by_priority_then_arrival() -> None:
    sched = make(64, max_seqs=1, budget=256, policy="priority")
    for name, priority in [("low", 5), ("urgent", -1), ("mid", 3), ("mid2", 3)]:
        add(sched, name, 10, first=len(name) * 100, priority=priority)
    order = []
    while sched.has_unfinished():
        running = sched.running[0] if sched.running else None
        run_step(sched)
        if running is None:
            running = sched.running[0]
        order.append(running.request_id)
        sched.finish(running, "length")
    assert order == ["urgent", "mid", "mid2", "low"]
    assert sched.num_preemptions == 0  # one seat, one at a time: nothing worse runs to preempt


# (name, prompt length, priority) of the sequences already running, in arrival order
Running = list[tuple[str, int, int]]


@pytest.mark.parametrize(
    ("running", "waiting", "num_blocks", "max_seqs", "budget", "victims", "admitted"),
    [
        # no seat left: the worst priority goes
        ([("a", 10, 1), ("b", 10, 2), ("c", 10, 1)], ("hi", 10, 0), 64, 3, 256, ["b"], True),
        # among equals the latest arrival goes
        ([("a", 10, 1), ("b", 10, 1)], ("hi", 10, 0), 64, 2, 256, ["b"], True),
        # only a strictly worse priority is preempted: an equal waits
        ([("a", 10, 1), ("b", 10, 1)], ("eq", 10, 1), 64, 2, 256, [], False),
        ([("a", 10, 2), ("b", 10, 1)], ("mid", 10, 1), 64, 2, 256, ["a"], True),
        ([("a", 10, 0)], ("worse", 10, 1), 64, 1, 256, [], False),
        # the KV pool is full (2 blocks each): one victim frees enough, the later one
        ([("a", 20, 1), ("b", 20, 1)], ("hi", 20, 0), 4, 8, 256, ["b"], True),
        # a prompt of 4 blocks needs both victims, latest first
        ([("a", 20, 1), ("b", 20, 1)], ("hi", 60, 0), 4, 8, 256, ["b", "a"], True),
        # a prompt larger than what worse ones hold preempts none of them in vain
        ([("a", 20, 0), ("b", 20, 1)], ("hi", 60, -1), 4, 8, 256, ["b", "a"], True),
        # the step budget is taken by a worse prefill: it goes, its tokens are the newcomer's
        ([("long", 100, 1)], ("hi", 10, 0), 64, 8, 32, ["long"], True),
    ],
)
def test_priority_preemption(
    running: Running,
    waiting: tuple[str, int, int],
    num_blocks: int,
    max_seqs: int,
    budget: int,
    victims: list[str],
    admitted: bool,
) -> None:
    sched = make(num_blocks, max_seqs, budget, policy="priority")
    for i, (name, length, priority) in enumerate(running):
        add(sched, name, length, first=i * 1000, priority=priority)
    run_step(sched)
    assert sorted(s.request_id for s in sched.running) == sorted(name for name, _, _ in running)
    name, length, priority = waiting
    newcomer = add(sched, name, length, first=9000, priority=priority)
    out = run_step(sched)
    assert [s.request_id for s in out.preempted] == victims
    assert (newcomer.status is SequenceStatus.RUNNING) == admitted
    assert name in planned(out) if admitted else name not in planned(out)
    assert out.num_batched_tokens <= budget and len(sched.running) <= max_seqs
    assert sched.preemptions["priority"] == len(victims) and sched.num_preemptions == len(victims)


def test_fcfs_never_preempts_for_a_waiting_request() -> None:
    sched = make(64, max_seqs=1, budget=256)
    add(sched, "a", 10)
    run_step(sched)
    add(sched, "b", 10, first=100)
    out = run_step(sched)
    assert out.preempted == [] and planned(out) == {"a": 1}


def test_fcfs_refuses_a_priority() -> None:
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        add(make(8), "x", 10, priority=1)


def test_a_preempted_sequence_resumes_from_the_prefix_cache_and_cannot_preempt_back() -> None:
    sched = make(num_blocks=8, max_seqs=1, budget=256, policy="priority")
    low = add(sched, "low", 40, priority=1)
    for _ in range(3):
        run_step(sched)  # 40 prompt tokens + 2 generated: 2 full blocks hashed
    high = add(sched, "high", 10, first=500, priority=0)
    out = run_step(sched)
    assert out.preempted == [low] and planned(out) == {"high": 10}
    assert low.num_output_tokens == 3 and low.status is SequenceStatus.WAITING
    for _ in range(4):  # while high runs, low waits: it never preempts a better one
        assert run_step(sched).preempted == []
    sched.finish(high, "length")
    num_tokens = low.num_tokens
    out = run_step(sched)
    # its two full blocks come back from the cache: only the last partial block is recomputed
    assert planned(out) == {"low": num_tokens - 32}
    assert low.num_computed_tokens == low.num_tokens - 1  # the token it sampled is next


def test_kv_preemption_under_priority_takes_the_worst_priority() -> None:
    """Blocks short for a running decode: the worst priority goes, not the newest arrival."""
    sched = make(num_blocks=4, budget=256, policy="priority")
    old_low = add(sched, "old_low", 30, first=0, priority=5)  # 2 blocks
    new_high = add(sched, "new_high", 31, first=100, priority=0)  # 2 blocks: the pool is full
    run_step(sched)
    run_step(sched)
    out = run_step(sched)  # one of them needs a 3rd block
    assert out.preempted == [old_low] and new_high.status is SequenceStatus.RUNNING
    assert sched.preemptions == {"kv_cache": 1}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_waiting_adapter_without_a_slot_is_passed_over_and_keeps_its_place(policy: str) -> None:
    # One adapter slot, held by A's running sequence: B (another adapter) cannot run, so the
    # base-model request behind it goes first; B stays ahead of later arrivals and runs once
    # A's slot frees.
    sched = Scheduler(BlockManager(64), 8, 256, LoraSlots(1), policy=policy)
    adapters = [LoraRequest(name, i, None) for i, name in enumerate("ab", 1)]  # type: ignore[arg-type]
    a = Sequence("a", list(range(10)), SamplingParams(), lora=adapters[0])
    b = Sequence("b", list(range(10)), SamplingParams(), lora=adapters[1])
    sched.add(a)
    run_step(sched)
    sched.add(b)
    base = add(sched, "base", 10)
    out = run_step(sched)
    assert "base" in planned(out) and "b" not in planned(out)
    assert [s.request_id for s in sched.waiting] == ["b"]
    later = add(sched, "later", 10)
    sched.finish(a, "stop")
    out = run_step(sched)
    assert "b" in planned(out) and b.lora_slot == 0
    assert later.status is SequenceStatus.RUNNING and base.status is SequenceStatus.RUNNING


# -- which adapters get the LoRA slots (engine/lora_policy.py) ------------------------------------

D = AdapterDemand


@pytest.mark.parametrize(
    ("demands", "running_users", "num_free", "step", "draining", "expected"),
    [
        ([], {}, 2, 10, None, SlotPlan()),
        ([D(1, 1, 0), D(2, 3, 5)], {}, 1, 63, None, SlotPlan()),  # none starved: queue order
        # waiting MAX_LORA_WAIT_STEPS: the free slots are theirs, oldest first
        ([D(1, 1, 0), D(2, 5, 10)], {}, 2, MAX_LORA_WAIT_STEPS, None, SlotPlan((1,), None, True)),
        ([D(2, 1, 1), D(1, 1, 0)], {}, 1, 70, None, SlotPlan((1,), None, True)),
        # starved without a free slot: the resident adapter with the fewest running drains
        ([D(1, 1, 0)], {7: 3, 8: 1, 9: 0}, 0, 64, None, SlotPlan((), 8, True)),
        ([D(1, 1, 0)], {7: 3, 8: 1}, 0, 64, 7, SlotPlan((), 7, True)),  # a drain under way holds
        ([D(1, 1, 0)], {7: 0}, 1, 64, 7, SlotPlan((1,), 7, True)),  # until the starved one is in
        ([D(1, 1, 0)], {7: 3, 8: 2}, 0, 64, 5, SlotPlan((), 8, True)),  # 5 is gone: another
        ([D(1, 1, 0), D(2, 1, 0)], {7: 3}, 1, 64, None, SlotPlan((1,), 7, True)),  # 2 left
    ],
)
def test_slot_plan(
    demands: list[AdapterDemand],
    running_users: dict[int, int],
    num_free: int,
    step: int,
    draining: int | None,
    expected: SlotPlan,
) -> None:
    assert plan_slots(demands, running_users, num_free, step, draining) == expected


def lora_seq(request_id: str, adapter: LoraRequest, length: int = 10) -> Sequence:
    return Sequence(request_id, list(range(length)), SamplingParams(max_tokens=100), lora=adapter)


def adapters(names: str) -> list[LoraRequest]:
    return [LoraRequest(name, i, None) for i, name in enumerate(names, 1)]  # type: ignore[arg-type]


def test_free_slots_go_in_queue_order_and_loads_are_counted() -> None:
    a, b, c = adapters("abc")
    slots = LoraSlots(1)
    sched = Scheduler(BlockManager(64), 8, 256, slots)
    first = lora_seq("a", a)
    sched.add(first)
    run_step(sched)
    sched.add(lora_seq("b", b))  # first in line
    for i in range(2):
        sched.add(lora_seq(f"c{i}", c))
    run_step(sched)
    sched.finish(first, "stop")
    out = run_step(sched)
    assert list(planned(out)) == ["b"]
    assert [(slot, req.name) for slot, req in out.lora_loads] == [(0, "b")]
    assert (slots.num_loads, slots.num_evictions) == (2, 1)


def test_a_starved_adapter_drains_a_slot_then_takes_it() -> None:
    # One slot, a stream of a's requests keeps it busy forever; b waits. After the bound, a
    # admits no new request, its running ones finish, and b gets the slot.
    a, b = adapters("ab")
    sched = Scheduler(BlockManager(256), 8, 256, LoraSlots(1))
    assert sched.lora is not None
    sched.lora.max_wait = 3
    sched.add(lora_seq("a0", a))
    run_step(sched)
    sched.add(lora_seq("b", b))
    started_after_drain: list[str] = []
    for step in range(1, 12):
        sched.add(lora_seq(f"a{step}", a))
        out = run_step(sched)
        if sched.lora.draining is not None:  # a's newly admitted (prefilling) requests
            started_after_drain += [
                s.seq.request_id for s in out.scheduled if s.seq.lora is a and s.num_new_tokens > 1
            ]
        for seq in list(sched.running):  # each a runs 2 steps
            if seq.lora is a and seq.num_computed_tokens >= 11:
                sched.finish(seq, "stop")
        if "b" in planned(out):
            break
    assert "b" in planned(out), "b never got the slot"
    assert started_after_drain == []
    run_step(sched)
    assert sched.lora.draining is None  # b is in: a's requests wait for b's slot as usual
    assert {s.request_id for s in sched.waiting} == {f"a{step - 1}", f"a{step}"}
