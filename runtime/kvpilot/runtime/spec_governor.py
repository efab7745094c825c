"""Whether speculative proposals pay in this step, from what recent steps cost (pure Python).

A proposal is one more row through every matmul and attention, accepted or not. With step time
t = fixed + per_row x rows, R decoding sequences, D proposals of which A are accepted, a step
yields R + A tokens in fixed + per_row x (R + D) instead of R in fixed + per_row x R; that is
more tokens per second exactly when

    A / D  >  per_row x R / (fixed + per_row x R),

the acceptance rate beats the share of the step that grows with its rows. With one sequence the
fixed part (Python, kernel launches, reading the weights once) dominates and nearly any
acceptance pays; with 32 sequences of a small model the step is almost all per-row work and a
proposal accepted 60% of the time loses (bench.engine_spec measured 0.93x before this rule).

Both sides are measured as the engine runs: `StepCosts` fits fixed and per_row by exponentially
weighted least squares over recent decode steps (rows vary as requests come and go and as
proposals do), and the acceptance rate is a decayed ratio of recent proposals. Until the fit can
tell (too few steps, rows too alike), proposals go ahead; once it has, its last estimate stands
through stretches of alike rows (a batch that stops proposing has alike rows). While proposals
do not pay, one step in PROBE_EVERY proposes anyway, so that the acceptance rate follows what the
sequences now write (a batch turning to quoting text wins its proposals back).
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.97  # per step: the fit and the acceptance forget with a half-life of ~23 steps
MIN_STEPS = 16.0  # decayed weight (at most 33) before a fit counts: ~22 decode steps
MIN_EVIDENCE = 16.0  # decayed proposed tokens before their acceptance may stop proposals
SPIKE = 3.0  # a step slower than this many times the fit's prediction counts as this many
MIN_ROW_VARIANCE = 1.0  # rows^2: below it the rows are too alike to separate fixed from per-row
PROBE_EVERY = 50  # steps: while proposals do not pay, one step in this many proposes anyway


@dataclass
class StepCosts:
    """seconds ~ fixed + per_row x rows, fitted over recent steps (decayed sums)."""

    weight: float = 0.0
    sum_rows: float = 0.0
    sum_seconds: float = 0.0
    sum_rows_sq: float = 0.0
    sum_rows_seconds: float = 0.0
    last_fit: tuple[float, float] | None = None

    def add(self, rows: int, seconds: float) -> None:
        """One step; a stall (the thread descheduled, a collection) is clipped to SPIKE times
        what the fit predicts, so that one does not decide the slope."""
        if self.last_fit is not None:
            fixed, per_row = self.last_fit
            seconds = min(seconds, SPIKE * (fixed + per_row * rows))
        self.weight = self.weight * DECAY + 1
        self.sum_rows = self.sum_rows * DECAY + rows
        self.sum_seconds = self.sum_seconds * DECAY + seconds
        self.sum_rows_sq = self.sum_rows_sq * DECAY + rows * rows
        self.sum_rows_seconds = self.sum_rows_seconds * DECAY + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_row) seconds from the recent steps, or the last such estimate while
        they cannot tell them apart; None before there has been one."""
        if self.weight < MIN_STEPS:
            return self.last_fit
        mean_rows = self.sum_rows / self.weight
        mean_seconds = self.sum_seconds / self.weight
        variance = self.sum_rows_sq / self.weight - mean_rows**2
        if variance < MIN_ROW_VARIANCE:
            return self.last_fit
        covariance = self.sum_rows_seconds / self.weight - mean_rows * mean_seconds
        per_row = max(covariance / variance, 0.0)
        self.last_fit = max(mean_seconds - per_row * mean_rows, 0.0), per_row
        return self.last_fit


def proposals_pay(acceptance: float, costs: tuple[float, float] | None, num_rows: int) -> bool:
    """Whether proposing beats not proposing for a step of `num_rows` decoding sequences (see
    the module's docstring); True while the costs are unknown."""
    if costs is None or num_rows <= 0:
        return True
    fixed, per_row = costs
    grows = per_row * num_rows
    return acceptance * (fixed + grows) > grows


@dataclass
class Governor:
    """The engine's running view: step costs and the acceptance rate of recent proposals."""

    costs: StepCosts
    proposed: float = 0.0  # decayed proposal counts; the rate starts at 1 (optimistic)
    accepted: float = 0.0
    steps_without: int = 0  # steps in a row in which proposals did not pay

    def on_step(self, rows: int, seconds: float) -> None:
        self.costs.add(rows, seconds)

    def on_proposals(self, proposed: int, accepted: int) -> None:
        """One step's proposals of all sequences together."""
        self.proposed = self.proposed * DECAY + proposed
        self.accepted = self.accepted * DECAY + accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 1.0

    def pays(self, num_rows: int) -> bool:
        """Whether this step proposes: where proposals pay (or too few have been made to
        tell), and one step in PROBE_EVERY."""
        if self.proposed < MIN_EVIDENCE or proposals_pay(
            self.acceptance, self.costs.fit(), num_rows
        ):
            self.steps_without = 0
            return True
        self.steps_without += 1
        return self.steps_without % PROBE_EVERY == 0
