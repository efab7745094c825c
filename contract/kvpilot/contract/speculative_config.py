"""`--speculative-config`: the speculative-decoding settings, the one schema the runtime's flag and
the ModelDeployment's `spec.serving.speculative` both parse into (vLLM's JSON keys)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")
KEYS_OF = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
    "draft_model": {"method", "num_speculative_tokens", "model"},
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # proposals per step, at most
    prompt_lookup_max: int = 4  # the longest suffix matched against earlier text
    # The shortest; shorter matches propose nothing. A one-token match is weak evidence (any
    # common token recurs), and every proposal costs a row in the step whether accepted or not;
    # compare with bench.engine_spec after setting "prompt_lookup_min": 1 in its NGRAM.
    prompt_lookup_min: int = 2
    # draft_model: the small model's directory (the same tokenizer as the served model's)
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; supported: {', '.join(METHODS)}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                'speculative method "draft_model" needs "model" (the draft model\'s directory), '
                "and only it takes one"
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
        raise ValueError(f'--speculative-config needs a "method" (supported: {", ".join(METHODS)})')
    for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        if key in raw and (not isinstance(raw[key], int) or isinstance(raw[key], bool)):
            raise ValueError(f"--speculative-config: {key} must be an integer, got {raw[key]!r}")
    if "model" in raw and (not isinstance(raw["model"], str) or not raw["model"]):
        raise ValueError(f"--speculative-config: model must be a path, got {raw['model']!r}")
    foreign = sorted(set(raw) - KEYS_OF.get(raw["method"], set(KEYS)))
    if foreign:
        raise ValueError(
            f"--speculative-config: {', '.join(foreign)} does not apply to method {raw['method']!r}"
        )
    return SpeculativeConfig(**raw)
