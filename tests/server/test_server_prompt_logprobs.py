"""Prompt logprobs with the official openai client: OpenAI's legacy echo + logprobs (max_tokens 0
or 1, as lm-eval's loglikelihood requests send them) and vLLM's prompt_logprobs."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai import OpenAI

from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sampling import PromptLogprob, SamplingParams
from tests.support.server_process import MODEL, TINY, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

TEXTS = ["The sort method orders a list in place.", "def main():\n    return 0"]


@pytest.fixture(scope="module")
def client(server: RuntimeServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model=str(TINY), max_model_len=512))


def prompts(engine: Engine) -> list[list[int]]:
    return [[1, *engine.tokenizer.encode(text)] for text in TEXTS]


def scored(engine: Engine, prompt: list[int], num_top: int) -> list[PromptLogprob]:
    """The in-process engine's prompt logprobs: the reference the server's must equal."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=num_top)
    engine.add_request(prompt, params, "reference")
    result: list[PromptLogprob] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            result += out.prompt_logprobs or []
    return result


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_score_every_prompt_token(
    client: OpenAI, engine: Engine, max_tokens: int
) -> None:
    """lm-eval's loglikelihood request: several token-id prompts, echo, logprobs=1."""
    ids = prompts(engine)
    resp = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0
    )
    assert resp.usage is not None
    assert resp.usage.completion_tokens == max_tokens * len(ids)
    for choice, prompt in zip(resp.choices, ids, strict=True):
        reference = scored(engine, prompt, 1)
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None
        assert len(logprobs.token_logprobs) == len(prompt) + max_tokens
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        for position, expected in enumerate(reference, start=1):
            assert logprobs.token_logprobs[position] == pytest.approx(expected.logprob, abs=1e-4)
            top = logprobs.top_logprobs[position]
            # The most likely token's logprob is there (lm-eval's is_greedy compares with it).
            assert max(top.values()) == pytest.approx(max(expected.top.values()), abs=1e-4)
        text = engine.tokenizer.decode(prompt)
        assert choice.text == text if max_tokens == 0 else choice.text.startswith(text)


def test_vllm_prompt_logprobs(client: OpenAI, engine: Engine) -> None:
    prompt = prompts(engine)[0]
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": 2},
    )  # fmt: skip
    entries: list[Any] = resp.choices[0].prompt_logprobs  # type: ignore[attr-defined]
    assert entries[0] is None and len(entries) == len(prompt)
    for token_id, entry, expected in zip(
        prompt[1:], entries[1:], scored(engine, prompt, 2), strict=True
    ):
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(expected.logprob, abs=1e-4)
        assert own["rank"] == expected.rank
        assert own["decoded_token"] == engine.tokenizer.decode([token_id])
        assert {str(t) for t in expected.top} <= entry.keys()
    assert resp.choices[0].logprobs is None  # prompt_logprobs alone asks nothing of the output


def test_streamed_echo_scores_the_prompt(client: OpenAI, engine: Engine) -> None:
    prompt = prompts(engine)[1]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, stream=True
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == engine.tokenizer.decode(prompt)
    logprobs = [lp for c in chunks for lp in (c.choices[0].logprobs.token_logprobs or [])]  # type: ignore[union-attr]
    assert len(logprobs) == len(prompt) and logprobs[0] is None
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda c: c.completions.create(model=MODEL, prompt="x", max_tokens=0), "max_tokens"),
        (
            lambda c: c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                extra_body={"prompt_logprobs": 1},
            ),
            "prompt_logprobs",
        ),
    ],
    ids=["max_tokens 0 without echo", "prompt_logprobs on chat"],
)
def test_what_cannot_be_served_is_a_400_naming_it(client: OpenAI, call: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call(client)
    assert info.value.body["param"] == param  # type: ignore[index]
