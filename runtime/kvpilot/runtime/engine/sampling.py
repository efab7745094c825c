"""Sampling parameters and the pure text-side rules: stop strings and what text may be emitted.

The tensor side (penalties, logit bias, min_tokens, temperature, min-p, top-k, top-p, seeded
draws, logprobs) lives in layers/sampler.py, batched over the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.runtime.engine.structured import GrammarSpec


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 => disabled
    seed: int | None = None
    min_p: float = 0.0  # [0, 1]: drop tokens below min_p x the top token's probability
    stop: tuple[str, ...] = ()  # stop strings (not in the output text unless included below)
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    logprobs: int | None = None  # top-N logprobs per generated token (None = off)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token after the first
    # OpenAI semantics over the generated tokens; vLLM's repetition penalty over prompt + output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages, < 1 encourages repeats
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    grammar: GrammarSpec | None = None  # the output must match it (structured outputs, tools)
    # The scheduler's, not the sampler's: lower runs first under --scheduling-policy priority
    # (vLLM's request `priority`). It travels here as every other per-request option does.
    priority: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 or None, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0 or None, got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        self._check_sampling_extras()

    def _check_sampling_extras(self) -> None:
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(t < 0 for t, _ in self.logit_bias):
            raise ValueError("logit_bias token ids must be >= 0")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def effective_top_k(self) -> int:
        """0 when top-k is disabled (the API allows both 0 and -1 for that)."""
        return max(self.top_k, 0)


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token scored by the model: its logprob and rank (1 = the most likely) given
    the tokens before it, and the `num_top` most likely tokens' logprobs there."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]


def find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Index in `text` where the earliest stop string begins, searching from `start`, or None."""
    match = find_stop_match(text, stops, start)
    return match[0] if match else None


def find_stop_match(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in `text` from `start`, or None; of
    two starting at the same index, the one listed first."""
    found = [(index, stop) for stop in stops if (index := text.find(stop, start)) != -1]
    return min(found, key=lambda match: match[0]) if found else None


def stop_search_start(previous_len: int, stops: tuple[str, ...]) -> int:
    """A stop string can end in new text but start up to len(stop) - 1 characters before it."""
    longest = max((len(s) for s in stops), default=1)
    return max(0, previous_len - longest + 1)


def num_emittable_chars(text: str, stops: tuple[str, ...], is_finished: bool) -> int:
    """How much of `text` may be streamed now.

    Held back: a trailing U+FFFD (half of a multi-byte character the next token completes) and,
    while running, the longest tail that could still grow into a stop string, so that no part of
    a stop string is ever streamed.
    """
    if is_finished:
        return len(text)
    end = len(text)
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    for stop in stops:
        for size in range(min(len(stop) - 1, end), 0, -1):
            if text[end - size : end] == stop[:size]:
                return end - size
    return end
