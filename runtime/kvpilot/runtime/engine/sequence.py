"""A request's token state as the scheduler and block manager see it (pure Python)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.runtime.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from kvpilot.runtime.engine.lora_slots import LoraRequest

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class DraftPace:
    """A sequence's proposal budget for its next steps (speculative.pace moves it)."""

    budget: int | None = None  # proposals allowed next; None: the configured k
    skip: int = 0  # steps to propose nothing before trying again
    misses: int = 0  # proposals rejected outright, in a row


@dataclass
class Timestamps:
    """Moments of one request on the engine's clock (time.monotonic, set by the engine), from
    which the per-phase latency metrics are taken as vLLM defines them: queued until first
    scheduled, prefill until the first token, decode from there to the last token."""

    queued: float = field(default_factory=time.monotonic)  # the Sequence's creation
    scheduled: float | None = None  # the first time the scheduler ran it (not after preemption)
    first_token: float | None = None
    last_token: float | None = None

    def on_scheduled(self, now: float) -> None:
        if self.scheduled is None:
            self.scheduled = now

    def on_token(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        self.last_token = now


@dataclass(eq=False)
class Sequence:
    """One request. `num_computed_tokens` counts tokens whose KV is in the cache (vLLM v1): a
    prefill is simply a sequence far behind its token count, a decode one token behind."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, first admission
    times: Timestamps = field(default_factory=Timestamps)
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_scored_prompt_tokens: int = 0  # prompt positions whose logprobs are out (prompt_logprobs)
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    is_admitted_once: bool = False
    # The output grammar's matcher (params.grammar compiled), advanced with each output token.
    grammar: LLMatcher | None = None
    # Tokens proposed for this step by speculative decoding (engine/speculative.py); the step checks
    # them after the last known token, and they are cleared once it has.
    draft_token_ids: list[int] = field(default_factory=list)
    # How this sequence's proposals have fared (speculative.pace), which bounds the next ones.
    draft_pace: DraftPace = DraftPace()
    # The LoRA adapter the sequence runs under (None: the base model), and the slot it holds in
    # the model while running (engine/lora_slots.py; -1: none).
    lora: LoraRequest | None = None
    lora_slot: int = -1

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("prompt must contain at least one token")
        if self.num_prompt_tokens == 0:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def lora_id(self) -> int:
        """The adapter's id for this load, 0 for the base model (the prefix cache's key)."""
        return 0 if self.lora is None else self.lora.lora_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
