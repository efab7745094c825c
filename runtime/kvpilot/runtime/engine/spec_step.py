"""Speculative decoding's part in an engine step: the proposals before it, and after it the
accepted ones counted and the step measured for the governor (engine/spec_governor.py)."""

from __future__ import annotations

from collections.abc import Iterable

from kvpilot.contract.speculative_config import SpeculativeConfig
from kvpilot.runtime.engine import speculative
from kvpilot.runtime.engine.scheduler import ScheduledSequence
from kvpilot.runtime.engine.sequence import Sequence
from kvpilot.runtime.engine.spec_governor import Governor
from kvpilot.runtime.engine.stats import SpecDecodeCounts

Sample = tuple[ScheduledSequence, list[int], list[dict[int, float] | None]]  # (item, tokens, lps)


class SpecStep:
    """The proposals of the step under way, and the governor that allows them; the engine's
    step thread only. `counts` are the engine's, which its stats report."""

    def __init__(
        self, config: SpeculativeConfig | None, max_model_len: int, counts: SpecDecodeCounts
    ) -> None:
        self.config = config  # None: speculative decoding is off, and no method is called
        self.max_model_len = max_model_len
        self.counts = counts
        self.governor = Governor()
        self._drafted: list[Sequence] = []  # the sequences given proposals this step

    def propose(self, proposer: speculative.Proposer, running: Iterable[Sequence]) -> None:
        """This step's proposals, or a draft model's placeholders, for each decoding sequence
        that may have some. The last step's are spent (accepted, rejected or not scheduled) and
        cleared where they were made, so a step without proposals, the usual one where they do
        not pay, costs no work per sequence beyond counting the decoding ones."""
        for seq in self._drafted:
            seq.draft_token_ids = []
        self._drafted = []
        assert self.config is not None
        able = [seq for seq in running if speculative.can_speculate(seq)]
        # Proposals only where they have measured faster (spec_governor); its epochs count the
        # steps in which some sequence could propose, not idle ones or prefills.
        if not able or not self.governor.pays(len(able)):
            return
        for seq in able:
            budget = speculative.draft_budget(seq, self.config, self.max_model_len)
            if budget:
                seq.draft_token_ids = proposer.reserve(seq, budget)
                self._drafted.append(seq)

    def count_drafts(self, item: ScheduledSequence, num_accepted: int) -> None:
        """The sequence's pace follows its acceptance, and the acceptance counters (vLLM's
        spec_decode metrics) move; the scheduler has already kept the accepted proposals' KV."""
        assert self.config is not None
        seq = item.seq
        seq.draft_pace = speculative.pace(
            seq.draft_pace, self.config.num_speculative_tokens, item.num_draft_tokens,
            num_accepted,
        )  # fmt: skip
        self.counts.drafts += 1
        self.counts.draft_tokens += item.num_draft_tokens
        self.counts.accepted_tokens += num_accepted

    def measure(
        self,
        scheduled: list[ScheduledSequence],
        samples: list[Sample],
        num_step_tokens: int,
        seconds: float,
    ) -> None:
        """The tokens a step of decodes gave out and its time, for the governor's rates (a
        step with a prefill chunk measures the prompt, not the proposals). Each scheduled
        sequence brings at least one known token, so the step is all decodes when it ran one
        token per sequence besides the proposals."""
        num_drafts = sum(item.num_draft_tokens for item in scheduled) if self._drafted else 0
        if num_step_tokens != len(scheduled) + num_drafts:
            return
        tokens = sum(len(tokens) for _, tokens, _ in samples) if num_drafts else len(samples)
        self.governor.on_step(tokens, seconds, num_drafts > 0, len(scheduled))
