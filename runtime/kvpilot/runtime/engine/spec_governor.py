"""Whether speculative proposals pay, measured rather than modelled (pure Python).

A proposal is one more row through every matmul and attention, accepted or not. With one
sequence the fixed part of a step (Python, kernel launches, reading the weights once) dominates
and nearly any acceptance pays; with 32 sequences of a small model a step is almost all per-row
work and a proposal accepted 60% of the time loses (bench.engine_spec: 0.85x). Where the line
falls depends on the model, the machine, the batch and the text, and a cost model fitted to step
times missed it (proposal rows cost more than its line said, and contexts grow as a run goes),
so the governor compares what it is after directly: output tokens per second of decode steps,
with proposals and without.

Below SMALL_BATCH decoding sequences proposals always run and nothing is measured: there the
fixed part of a step dominates on any model (a proposal row is nearly free), and with so few
sequences the two rates would compare stretches of different text (the start of an answer
proposes little, a quote copied later a lot), which the per-sequence pace already follows.

A step counts for the rate with proposals when some sequence proposed in it, and for the one
without otherwise (a step allowed to propose in which no sequence found anything to propose ran
exactly as one without). Steps run in epochs of EPOCH; in each cycle of `cycle` epochs all but
the last allow proposals or not as the faster rate says, and the last does the other, so both
rates stay current (decayed sums of tokens and seconds; a rate counts after MIN_STEPS steps).
Until proposals have a rate they are
allowed (nothing is lost while none is made); until steps without them have one, epochs
alternate. The check epoch costs the time the slower mode takes over the faster one's, so the
cycle grows with the lead (`cycle_epochs`) to keep that under CHECK_COST of the time: modes
within a few percent are checked every CYCLE epochs (little to lose, and the lead may turn), a
clear loser at most every LONG_CYCLE (the longest a change of workload goes unnoticed; each
mode's sums weigh less with every step of the other, so one check reads the change).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

EPOCH = 8  # steps run in one mode before the next is chosen
CYCLE = 8  # the fewest epochs per cycle (modes close): the last runs the slower one
# The most epochs per cycle (one mode far ahead): 1,024 steps, ~3 s of tiny-llama at 32
# sequences, ~2 min of the compute-bound bench model's (bench.engine_spec).
LONG_CYCLE = 128
# The share of time the check epochs may cost. bench.engine_spec, tiny-llama at 32 sequences:
# proposals' steps measured 1.4-3x as long per token there, and a check every 8 epochs cost
# 2-4% (0.96-0.98x).
CHECK_COST = 0.005
DECAY = 0.98  # per recorded step: a mode's rate follows its last ~50 steps
SMALL_BATCH = 4  # decoding sequences below which proposals always run, unmeasured
MIN_STEPS = 6.0  # decayed steps before a mode's rate counts (one rejected proposal is no rate)


@dataclass
class Rate:
    """Decayed output tokens and seconds of one mode's decode steps."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * DECAY + tokens
        self.seconds = self.seconds * DECAY + seconds
        self.steps = self.steps * DECAY + 1

    def age(self) -> None:
        """A step of the other mode: what this one measured weighs less against what it will
        measure next, while the rate stays as measured. Checked one epoch in up to LONG_CYCLE, a
        mode would otherwise take several checks to show that the workload changed."""
        self.tokens *= DECAY
        self.seconds *= DECAY

    @property
    def per_second(self) -> float | None:
        """Tokens per second, None until MIN_STEPS steps have been measured."""
        if self.steps < MIN_STEPS or self.seconds <= 0:
            return None
        return self.tokens / self.seconds


@dataclass
class Governor:
    """Chooses, before each step, whether it proposes (`pays`), and learns from what the step
    gave (`on_step`)."""

    with_proposals: Rate = field(default_factory=Rate)
    without: Rate = field(default_factory=Rate)
    steps: int = 0
    proposing: bool = True  # this step's mode

    def pays(self, num_rows: int) -> bool:
        """Whether a step of `num_rows` decoding sequences may propose."""
        if num_rows < SMALL_BATCH:
            self.proposing = True
            return True
        self.proposing = choose(self.with_proposals.per_second, self.without.per_second, self.steps)
        self.steps += 1
        return self.proposing

    def on_step(self, tokens: int, seconds: float, proposed: bool, num_rows: int) -> None:
        """A decode step of `num_rows` sequences: the tokens it gave out, its time, and whether
        any sequence proposed."""
        if num_rows >= SMALL_BATCH:
            measured, other = (
                (self.with_proposals, self.without)
                if proposed
                else (self.without, self.with_proposals)
            )
            measured.add(tokens, seconds)
            other.age()


def choose(rate_with: float | None, rate_without: float | None, step: int) -> bool:
    """Whether step `step` proposes, given each mode's recent tokens per second."""
    epoch = step // EPOCH
    if rate_with is None:
        return True  # nothing proposed yet, so nothing to lose by allowing it
    if rate_without is None:
        return epoch % 2 == 0
    leader_is_with = rate_with >= rate_without
    cycle = cycle_epochs(max(rate_with, rate_without) / min(rate_with, rate_without))
    is_check = epoch % cycle == cycle - 1
    return leader_is_with != is_check


def cycle_epochs(lead: float) -> int:
    """Epochs per cycle when the faster mode's rate is `lead` times the slower one's: the check
    epoch takes lead - 1 epochs' time more than the faster mode would, of n + lead - 1 in the
    cycle, which is at most CHECK_COST from n = (lead - 1) (1 / CHECK_COST - 1)."""
    epochs = math.ceil((lead - 1) * (1 / CHECK_COST - 1) - 1e-9)  # an exact product stays
    return min(LONG_CYCLE, max(CYCLE, epochs))
