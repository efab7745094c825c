"""Logprobs a response states are JSON numbers: a token the sampler could not pick (-inf: masked
by a grammar, or pushed below float range by a penalty) and NaN read as vLLM's floor, -9999.0,
instead of failing the response ("Out of range float values are not JSON compliant", found by
test_server_fuzz with `repetition_penalty: 5e-324` and `logprobs: 0`)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel

from kvpilot.runtime.engine.sampling import PromptLogprob
from kvpilot.runtime.models.tokenizer_files import Tokenizer
from kvpilot.runtime.server.rendering import (
    LOGPROB_FLOOR,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    json_logprob,
    vllm_prompt_logprobs,
)
from tests.support.model_sources import MODEL_DIR

TOKENIZER = Tokenizer(MODEL_DIR)  # tiny-llama's own


INF, NAN = float("-inf"), float("nan")


@pytest.mark.parametrize(
    ("logprob", "stated"),
    [(-0.5, -0.5), (0.0, 0.0), (-9999.0, -9999.0), (-1e6, LOGPROB_FLOOR), (INF, LOGPROB_FLOOR),
     (NAN, LOGPROB_FLOOR)],
)  # fmt: skip
def test_json_logprob(logprob: float, stated: float) -> None:
    assert json_logprob(logprob) == stated


RENDERERS: dict[str, Callable[[float], Any]] = {
    "completion": lambda lp: completion_logprobs(TOKENIZER, [1, 2], [{1: lp}, {2: -0.1, 3: lp}], 0),
    "chat": lambda lp: chat_logprobs(TOKENIZER, [1, 2], [{1: lp}, {2: -0.1, 3: lp}], 2),
    "echo": lambda lp: echo_logprobs(TOKENIZER, [0, 1], [PromptLogprob(1, lp, 5, {2: lp})], 1),
    "prompt_logprobs": lambda lp: vllm_prompt_logprobs(
        TOKENIZER, [PromptLogprob(1, lp, 5, {2: lp})], 1
    ),
}


def floats(value: object) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [f for v in value.values() for f in floats(v)]
    if isinstance(value, list):
        return [f for v in value for f in floats(v)]
    return []


@pytest.mark.parametrize("renderer", sorted(RENDERERS))
@pytest.mark.parametrize("logprob", [INF, NAN])
def test_every_rendered_logprob_is_a_json_number(renderer: str, logprob: float) -> None:
    rendered = RENDERERS[renderer](logprob)
    body: Any
    if isinstance(rendered, BaseModel):
        body = rendered.model_dump()
    else:
        body = [entry and {k: v.model_dump() for k, v in entry.items()} for entry in rendered]
    json.dumps(body, allow_nan=False)  # what the server's JSONResponse does
    assert LOGPROB_FLOOR in floats(body)
    assert all(math.isfinite(f) for f in floats(body))
