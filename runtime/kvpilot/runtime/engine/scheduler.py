"""Continuous batching without prefill/decode phases (vLLM v1 style, pure Python).

Each step every running sequence asks for `num_tokens - num_computed_tokens` more tokens (a decode
asks for 1, a prefill for its whole remaining prompt), capped by the per-step token budget, which
gives chunked prefill for free: a long prompt takes what is left of the budget after the running
decodes and finishes over several steps. Waiting sequences are admitted in the waiting queue's
order (engine/waiting_queue.py: arrival under fcfs, (priority, arrival) under priority), with no
skipping, so nothing starves behind a later or worse request, while the budget, `max_num_seqs`
and free blocks allow. When blocks run out the worst-ranked running sequence (the newest, under
fcfs) is preempted by recompute: its blocks are freed (full ones stay in the prefix cache until
evicted, so its return recomputes little) and it goes back to the queue, keeping its generated
tokens and its arrival.

Under `priority` a waiting sequence that cannot be admitted (no seat, blocks or budget left)
preempts running sequences of a strictly worse priority, worst first (latest arrival among
equals), until it fits. Only strictly worse ones: equals never preempt each other, so there is
no thrashing, and a preempted sequence never preempts the one that displaced it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.block_manager import BlockManager, TierLookup
from kvpilot.runtime.engine.lora_policy import LoraAdmission
from kvpilot.runtime.engine.lora_slots import LoraRequest, LoraSlots
from kvpilot.runtime.engine.sequence import Sequence, SequenceStatus
from kvpilot.runtime.engine.stats import PREEMPTED_FOR_KV_CACHE, PREEMPTED_FOR_PRIORITY
from kvpilot.runtime.engine.waiting_queue import check_priority, make_waiting_queue, rank


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # the proposals (speculative decoding) included
    num_draft_tokens: int = 0  # seq.draft_token_ids[:num_draft_tokens] run after the last token

    @property
    def is_sampling(self) -> bool:
        """The chunk reaches the last known token, so the model's output there is the next one
        (and, with proposals, its output at each proposal checks it)."""
        num_known = self.num_new_tokens - self.num_draft_tokens
        return self.seq.num_computed_tokens + num_known == self.seq.num_tokens

    @property
    def draft_token_ids(self) -> list[int]:
        return self.seq.draft_token_ids[: self.num_draft_tokens]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Adapters newly given a slot this step: the runner copies their weights in before it runs.
    lora_loads: list[tuple[int, LoraRequest]] = field(default_factory=list)
    is_short_of_blocks: bool = False  # a running sequence was preempted for KV blocks

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lora_slots: LoraSlots | None = None,
        policy: str = "fcfs",
    ) -> None:
        """`lora_slots`: the model's adapter slots, when LoRA is enabled."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.lora_slots = lora_slots
        self.lora = None if lora_slots is None else LoraAdmission(lora_slots)
        self.num_steps = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting = make_waiting_queue(policy)
        self.running: list[Sequence] = []
        self.preemptions: Counter[str] = Counter()  # by reason (stats.PREEMPTION_REASONS)

    @property
    def num_preemptions(self) -> int:
        return self.preemptions.total()

    def add(self, seq: Sequence, at_front: bool = False) -> None:
        """Queue `seq` last, or first (`at_front`) when it arrived before those waiting."""
        num_blocks = -(-seq.num_tokens // BLOCK_SIZE)
        if num_blocks > self.block_manager.num_total_blocks:
            raise ValueError(
                f"prompt needs {num_blocks} KV blocks, the pool has "
                f"{self.block_manager.num_total_blocks}"
            )
        check_priority(seq.priority, self.policy)
        self.waiting.push(seq, at_front)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.num_steps += 1
        budget = self._schedule_running(out)
        if not out.is_short_of_blocks:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput) -> int:
        budget = self.max_num_batched_tokens
        for seq in sorted(self.running, key=rank):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            # A decode with proposals asks for them too, as far as the budget goes.
            num_wanted = seq.num_uncomputed_tokens + _num_drafts(seq)
            num_new = min(num_wanted, budget)
            if not self._make_room(seq, num_new, out):
                continue
            self.block_manager.allocate_slots(seq, num_new)
            num_drafts = max(0, num_new - seq.num_uncomputed_tokens)
            out.scheduled.append(ScheduledSequence(seq, num_new, num_drafts))
            budget -= num_new
        return budget

    def _make_room(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt the worst-ranked running sequences until `seq` fits; False if `seq` itself
        went."""
        while not self.block_manager.can_allocate_slots(seq, num_new):
            victim = max((s for s in self.running if s.status is SequenceStatus.RUNNING), key=rank)
            self._preempt(victim, out, PREEMPTED_FOR_KV_CACHE)
            out.is_short_of_blocks = True
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput, reason: str) -> int:
        """Back to the queue, its blocks freed; the step budget its slot in this step took."""
        self.block_manager.free(seq)
        self._release_lora(seq)
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        # A victim scheduled earlier in this step loses its slot too.
        dropped = [s for s in out.scheduled if s.seq is seq]
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        out.preempted.append(seq)
        self.waiting.push(seq, at_front=True)
        self.preemptions[reason] += 1
        return sum(s.num_new_tokens for s in dropped)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """In the waiting queue's order (engine/waiting_queue.py); a sequence whose adapter has
        no slot to run in is passed over (it keeps its place) until a slot frees, so the base
        model and resident adapters are not held up behind it. Which adapters get the slots
        that free is engine/lora_policy.py's choice, made once per step."""
        if self.lora is not None and self.waiting:
            self.lora.plan((seq.lora_id for seq in self.waiting), self.num_steps)
        passed_over: list[Sequence] = []
        while self.waiting:
            seq = self.waiting.peek()
            # The seat and budget first: without them the adapter check and the cache lookup (a
            # hash per prompt block) would run every step of a saturated server for nothing.
            if budget > 0 and len(self.running) < self.max_num_seqs:
                if not self._can_run_lora(seq):
                    passed_over.append(self.waiting.pop())
                    continue
                cached, lookup = self._find_prefix(seq)
                num_prefix = (len(cached) + len(lookup.hits)) * BLOCK_SIZE
                num_new = min(seq.num_tokens - num_prefix, budget)
                if self.block_manager.can_allocate_slots(seq, num_new, cached, len(lookup.hits)):
                    self._admit(seq, num_new, cached, lookup, out)
                    budget -= num_new
                    continue
            victim = self._priority_victim(seq, out, budget)
            if victim is None:
                break
            budget += self._preempt(victim, out, PREEMPTED_FOR_PRIORITY)
        for seq in reversed(passed_over):
            self.waiting.push(seq, at_front=True)

    def _admit(
        self,
        seq: Sequence,
        num_new: int,
        cached: list[int],
        lookup: TierLookup,
        out: SchedulerOutput,
    ) -> None:
        self.waiting.pop()
        num_pool = len(cached) * BLOCK_SIZE
        if not seq.is_admitted_once:
            seq.num_cached_tokens = num_pool + len(lookup.hits) * BLOCK_SIZE
            seq.is_admitted_once = True
        self.block_manager.record_lookup(seq, num_pool, lookup)
        self.block_manager.allocate_slots(seq, num_new, cached, lookup.hits)
        self._acquire_lora(seq, out)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append(ScheduledSequence(seq, num_new))

    def _priority_victim(self, seq: Sequence, out: SchedulerOutput, budget: int) -> Sequence | None:
        """The running sequence `seq` may preempt to get in (priority policy only): the
        worst-ranked one of a strictly worse priority. Where the step budget is what is missing,
        only one this step scheduled gives some back, so the worst such."""
        if self.policy != "priority":
            return None
        candidates = [s for s in self.running if s.priority > seq.priority]
        if budget == 0:
            in_step = {id(item.seq) for item in out.scheduled if item.num_new_tokens}
            candidates = [s for s in candidates if id(s) in in_step]
        return max(candidates, key=rank, default=None)

    def _can_run_lora(self, seq: Sequence) -> bool:
        if seq.lora is None:
            return True
        if self.lora is None:
            raise ValueError("a sequence names a LoRA adapter but LoRA is not enabled")
        return self.lora.can_admit(seq.lora.lora_id)

    def _acquire_lora(self, seq: Sequence, out: SchedulerOutput) -> None:
        if seq.lora is None or self.lora is None:
            return
        seq.lora_slot, is_new = self.lora.acquire(seq.lora.lora_id)
        if is_new:
            out.lora_loads.append((seq.lora_slot, seq.lora))

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0 and self.lora_slots is not None:
            self.lora_slots.release(seq.lora_slot)
        seq.lora_slot = -1

    def _find_prefix(self, seq: Sequence) -> tuple[list[int], TierLookup]:
        """The prefix already computed: blocks in the pool, then blocks a lower tier holds.
        Prompt logprobs need every prompt position's logits: nothing from the cache."""
        if seq.wants_prompt_logprobs:
            return [], TierLookup()
        cached = self.block_manager.find_cached_blocks(seq)
        return cached, self.block_manager.find_tier_blocks(seq, cached)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Mark the scheduled known tokens computed and hash the blocks they completed; the
        proposals count once the model has accepted them (`accept_drafts`)."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens - item.num_draft_tokens
            self.block_manager.cache_full_blocks(item.seq)

    def accept_drafts(self, item: ScheduledSequence, num_accepted: int) -> None:
        """After the step's tokens are appended: the accepted proposals' KV (written by the
        step) counts as computed; the slots of the rejected ones are given back, so a rejected
        proposal leaves nothing behind."""
        seq = item.seq
        seq.draft_token_ids = []
        if seq.is_finished or item.num_draft_tokens == 0:
            return
        seq.num_computed_tokens += num_accepted
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.free_tail(seq, seq.num_computed_tokens)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish (stop, length) or abort a sequence wherever it is, freeing its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release_lora(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.finish(reason)


def _num_drafts(seq: Sequence) -> int:
    """Proposals a running sequence brings: only a decode (one token behind) has any."""
    return len(seq.draft_token_ids) if seq.num_uncomputed_tokens == 1 else 0
