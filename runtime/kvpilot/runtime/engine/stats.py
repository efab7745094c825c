"""What the engine reports about itself between steps: read by the metrics collector at scrape
time and by the step listeners, without importing the engine (and torch) to do so."""

from __future__ import annotations

from dataclasses import dataclass

# Why a running sequence was preempted (the `reason` label of kvpilot_preemptions_by_reason):
# the KV pool had no block for a running sequence's next tokens, or a waiting request of a
# better priority needed its seat, blocks or step budget (--scheduling-policy priority).
PREEMPTED_FOR_KV_CACHE = "kv_cache"
PREEMPTED_FOR_PRIORITY = "priority"
PREEMPTION_REASONS = (PREEMPTED_FOR_KV_CACHE, PREEMPTED_FOR_PRIORITY)


@dataclass
class SpecDecodeCounts:
    """Speculative decoding so far, as vLLM counts it: steps in which a sequence proposed,
    the tokens proposed, and those the model accepted (cumulative)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_usage: float  # used blocks / total, 0..1
    prefix_cache_queries: int  # tokens, cumulative
    prefix_cache_hits: int  # tokens, cumulative
    num_preemptions: int  # cumulative, every reason
    num_step_tokens: int = 0  # tokens the last step ran through the model (prefill + decode)
    # speculative decoding, cumulative (SpecDecodeCounts)
    spec_decode_drafts: int = 0
    spec_decode_draft_tokens: int = 0
    spec_decode_accepted_tokens: int = 0
    # cumulative, by reason (PREEMPTION_REASONS); they add up to num_preemptions
    preemptions_by_reason: tuple[tuple[str, int], ...] = ()

    @classmethod
    def idle(cls) -> EngineStats:
        """The figures of a server whose engine is not loaded yet: nothing queued, no pool."""
        return cls(0, 0, 0, 0, 0.0, 0, 0, 0)
