"""Sampling options through the official openai client against a real server on the tiny model."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai import OpenAI

from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sampling import SamplingParams
from tests.support.server_process import MODEL, TINY, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

PROMPT = "def main():\n    return"
VOCAB_SIZE = 4096  # models/tiny-llama


@pytest.fixture(scope="module")
def client(server: RuntimeServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def complete(client: OpenAI, **fields: Any) -> Any:
    """A greedy completion of PROMPT; vLLM's extra fields go in the body as vLLM users send them."""
    extra = {key: fields.pop(key) for key in list(fields) if key in VLLM_FIELDS}
    fields.setdefault("max_tokens", 24)
    fields.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=PROMPT, extra_body=extra, **fields)


VLLM_FIELDS = {"min_tokens", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos",
               "include_stop_str_in_output", "top_k"}  # fmt: skip


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model=str(TINY), max_model_len=512))


def engine_ids(engine: Engine, params: SamplingParams) -> list[int]:
    """The in-process engine on PROMPT: the reference the server's answers must equal."""
    request_id = engine.add_request(PROMPT, params)
    ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == request_id
            ids += out.new_token_ids
    return ids


def test_logit_bias_forces_a_token(client: OpenAI, engine: Engine) -> None:
    forced = complete(client, max_tokens=6, logit_bias={"354": 100}).choices[0]
    assert forced.text == engine.tokenizer.decode([354] * 6)
    assert forced.text != complete(client, max_tokens=6).choices[0].text


def test_negative_logit_bias_bans_the_greedy_token(client: OpenAI, engine: Engine) -> None:
    (greedy,) = engine_ids(engine, SamplingParams(max_tokens=1, temperature=0))
    banned = complete(client, max_tokens=1, logprobs=1, logit_bias={str(greedy): -100})
    logprobs = banned.choices[0].logprobs
    # The raw distribution is reported: the banned token is still the top logprob.
    assert logprobs.tokens[0] != engine.tokenizer.decode([greedy])
    assert engine.tokenizer.decode([greedy]) in logprobs.top_logprobs[0]


@pytest.mark.parametrize(
    "fields",
    [
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"presence_penalty": -1.0},
        {"repetition_penalty": 1.8},
        {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "logit_bias": {"13": 5}},
    ],
)
def test_penalties_are_the_engines(client: OpenAI, engine: Engine, fields: dict) -> None:
    """The server maps each field to the sampler, and the penalties change the greedy text."""
    bias = tuple((int(k), float(v)) for k, v in fields.get("logit_bias", {}).items())
    params = {k: v for k, v in fields.items() if k != "logit_bias"}
    expected = engine_ids(
        engine, SamplingParams(max_tokens=32, temperature=0, logit_bias=bias, **params)
    )
    got = complete(client, max_tokens=32, **fields).choices[0].text
    assert got == engine.tokenizer.decode(expected)
    assert got != complete(client, max_tokens=32).choices[0].text


def test_frequency_penalty_breaks_loops(client: OpenAI) -> None:
    plain = complete(client, max_tokens=64, ignore_eos=True).choices[0].text.split()
    penalised = complete(client, max_tokens=64, ignore_eos=True, frequency_penalty=2.0)
    words = penalised.choices[0].text.split()
    assert len(set(words)) / len(words) > len(set(plain)) / len(plain)


def test_min_tokens_holds_back_a_stop_token(client: OpenAI, engine: Engine) -> None:
    (greedy,) = engine_ids(engine, SamplingParams(max_tokens=1, temperature=0))
    early = complete(client, stop_token_ids=[greedy])
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 1
    held = complete(client, stop_token_ids=[greedy], min_tokens=5)
    assert held.usage.completion_tokens >= 5


def test_min_p_one_keeps_only_the_top_token(client: OpenAI) -> None:
    greedy = complete(client).choices[0].text
    hot = complete(client, temperature=1.5, min_p=1.0, seed=3).choices[0].text
    assert hot == greedy


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias"),
        ({"stop_token_ids": [VOCAB_SIZE + 5]}, "stop_token_ids"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 30, "max_tokens": 10}, "min_tokens"),
        ({"min_p": 2}, "min_p"),
    ],
)
def test_bad_sampling_fields_are_400s_naming_them(
    client: OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, **fields)
    assert info.value.body["param"] == param  # type: ignore[index]
    assert param in info.value.body["message"]  # type: ignore[index]


def test_stop_string_is_the_stop_reason_and_may_be_included(client: OpenAI) -> None:
    greedy = complete(client, max_tokens=24).choices[0]
    assert greedy.finish_reason == "length" and greedy.stop_reason is None
    stop = greedy.text[6:9]
    cut = complete(client, stop=[stop, "never seen"]).choices[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (
        greedy.text[: greedy.text.index(stop)],
        "stop",
        stop,
    )
    kept = complete(client, stop=[stop], include_stop_str_in_output=True).choices[0]
    assert kept.text == greedy.text[: greedy.text.index(stop) + len(stop)]
    assert kept.stop_reason == stop


def test_stop_token_is_the_stop_reason_in_every_shape(client: OpenAI, engine: Engine) -> None:
    ids = engine_ids(engine, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    stop_id = ids[2]
    fields = {"stop_token_ids": [stop_id], "max_tokens": 24}
    whole = complete(client, **fields).choices[0]
    assert whole.stop_reason == stop_id and whole.text == engine.tokenizer.decode(ids[:2])
    included = complete(client, include_stop_str_in_output=True, **fields).choices[0]
    assert included.text == engine.tokenizer.decode(ids[:3])
    chunks = [c for c in complete(client, stream=True, **fields) if c.choices]
    assert chunks[-1].choices[0].stop_reason == stop_id
    assert all(c.choices[0].stop_reason is None for c in chunks[:-1])


def test_chat_choices_carry_the_stop_reason(client: OpenAI) -> None:
    def chat(**extra: Any) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What does the sort method do?"}],
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True, **extra},
        ).choices[0]

    plain = chat()
    stop = plain.message.content[4:7]
    cut = chat(stop=[stop])
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    kept = chat(stop=[stop], include_stop_str_in_output=True)
    assert kept.message.content == plain.message.content[: plain.message.content.index(stop) + 3]


@pytest.mark.parametrize("stream", [False, True])
def test_a_token_pushed_below_float_range_is_stated_at_the_logprob_floor(
    client: OpenAI, stream: bool
) -> None:
    # repetition_penalty 5e-324 divides the logits of seen tokens by ~0, and a grammar masks the
    # rest: logprobs of -inf, which JSON cannot carry (the 500 test_server_fuzz found).
    extra = {"repetition_penalty": 5e-324, "guided_json": {}}
    fields: dict[str, Any] = {"logprobs": 0, "max_tokens": 4, "temperature": 0, "stream": stream}
    answer = client.completions.create(model=MODEL, prompt="", extra_body=extra, **fields)
    chunks = list(answer) if stream else [answer]
    stated = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert stated and all(-9999.0 <= lp <= 0 for lp in stated), stated
