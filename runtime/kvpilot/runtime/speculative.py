"""Speculative decoding by prompt lookup (vLLM's `ngram` method), pure Python.

A decoding sequence whose last few tokens appeared earlier in its own text (a summary quoting its
source, a code edit repeating the file) proposes the tokens that followed them then. The step
runs the last known token and the k proposals through the model at once, like a short prefill
chunk over the cached context; the model's own choice at each position is kept, and the
proposals count only as far as they agree with it (see `num_accepted`). Greedy output is the
same token for token as without speculation, and a step yields 1 + accepted tokens instead of 1.

Only greedy requests without a grammar propose: sampled tokens would need rejection sampling to
keep their distribution, and a grammar would have to advance over the proposals. Configured as
vLLM does: `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4}'`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvpilot.runtime.sequence import Sequence

METHODS = ("ngram",)
NOT_YET = {"draft_model": "a draft model is not supported yet; use method 'ngram'"}
MAX_SPECULATIVE_TOKENS = 16
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # proposals per step, at most
    prompt_lookup_max: int = 4  # the longest suffix matched against earlier text
    prompt_lookup_min: int = 1  # the shortest; shorter matches propose nothing

    def __post_init__(self) -> None:
        if self.method in NOT_YET:
            raise ValueError(f"speculative method {self.method!r}: {NOT_YET[self.method]}")
        if self.method not in METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; supported: {', '.join(METHODS)}"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )


def parse_config(text: str) -> SpeculativeConfig:
    """`--speculative-config`'s JSON object; ValueError that says what is wrong."""
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--speculative-config is not JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError('--speculative-config must be a JSON object, e.g. {"method": "ngram"}')
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(
            f"--speculative-config: unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}"
        )
    if "method" not in raw:
        raise ValueError('--speculative-config needs a "method" (supported: ngram)')
    for key in KEYS[1:]:
        if key in raw and (not isinstance(raw[key], int) or isinstance(raw[key], bool)):
            raise ValueError(f"--speculative-config: {key} must be an integer, got {raw[key]!r}")
    return SpeculativeConfig(**raw)


def propose(token_ids: list[int], config: SpeculativeConfig, limit: int) -> list[int]:
    """Up to min(k, limit) tokens that followed the most recent earlier occurrence of the
    longest suffix (prompt_lookup_max down to prompt_lookup_min tokens) of `token_ids`."""
    count = min(config.num_speculative_tokens, limit)
    if count <= 0:
        return []
    for size in range(min(config.prompt_lookup_max, len(token_ids) - 1), 0, -1):
        if size < config.prompt_lookup_min:
            break
        start = _last_earlier_match(token_ids, size)
        if start is not None:
            return token_ids[start + size : start + size + count]
    return []


def _last_earlier_match(token_ids: list[int], size: int) -> int | None:
    """Where the suffix of `size` tokens last occurred before itself (it may overlap)."""
    suffix = token_ids[-size:]
    last = suffix[-1]
    # Scan backwards for the suffix's last token, then compare the rest: most positions fail at
    # the first comparison, so this is one pass over the text per step.
    end = len(token_ids) - 1  # exclusive: the suffix's own last token is not a match
    while True:
        try:
            index = _rindex(token_ids, last, end)
        except ValueError:
            return None
        start = index - size + 1
        if start >= 0 and token_ids[start : index + 1] == suffix:
            return start
        end = index


def _rindex(values: list[int], value: int, end: int) -> int:
    """The last index of `value` in values[:end]; ValueError when absent."""
    for index in range(end - 1, -1, -1):
        if values[index] == value:
            return index
    raise ValueError(value)


def can_speculate(seq: Sequence) -> bool:
    """Whether `seq` may propose: greedy, no grammar, decoding (one token behind)."""
    params = seq.params
    return params.is_greedy and params.grammar is None and seq.num_uncomputed_tokens == 1


def draft_limit(seq: Sequence, max_model_len: int) -> int:
    """Proposals that fit: the step yields up to limit + 1 tokens, within max_tokens and the
    model's context."""
    left_in_request = seq.params.max_tokens - seq.num_output_tokens - 1
    left_in_context = max_model_len - seq.num_tokens - 1
    return max(0, min(left_in_request, left_in_context))


def num_accepted(drafts: list[int], chosen: list[int]) -> int:
    """How many proposals the model agreed with, from the first: `chosen[i]` is the model's
    token after the context and drafts[:i]; the first disagreement ends the run."""
    count = 0
    for draft, token in zip(drafts, chosen, strict=False):
        if draft != token:
            break
        count += 1
    return count
