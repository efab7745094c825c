"""The official openai client against a real server process on the tiny model."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.server.chat_template import render_chat
from tests.support.server_process import MODEL, TINY, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

PROMPTS = ["The list", "def main():\n    return", "Return a new"]
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What does the sort method do?"},
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model=str(TINY), max_model_len=512, max_num_seqs=8))


def engine_greedy(engine: Engine, prompt: str | list[int], max_tokens: int) -> tuple[str, int]:
    """The engine driven in-process: the reference the HTTP answers must equal."""
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    text, num_tokens = "", 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == request_id
            text += out.new_text
            num_tokens = out.num_output_tokens
    return text, num_tokens


@pytest.fixture(scope="module")
def client(server: RuntimeServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_engine(client: OpenAI, engine: Engine, prompt: str) -> None:
    expected_text, expected_tokens = engine_greedy(engine, prompt, 16)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    choice = resp.choices[0]
    assert choice.text == expected_text
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert resp.usage.completion_tokens == expected_tokens
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + expected_tokens
    assert choice.finish_reason == ("length" if expected_tokens == 16 else "stop")
    assert resp.model == MODEL


def test_streamed_completion_equals_non_streamed(client: OpenAI) -> None:
    prompt = PROMPTS[0]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_chat_completion_greedy_equals_engine(client: OpenAI, engine: Engine) -> None:
    tok = engine.tokenizer
    prompt = render_chat(tok.chat_template, MESSAGES, bos_token=tok.bos_token)
    expected_text, expected_tokens = engine_greedy(engine, prompt, 12)
    resp = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
    )
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected_text
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(tok.encode(prompt))
    assert resp.usage.completion_tokens == expected_tokens


def test_streamed_chat_equals_non_streamed(client: OpenAI) -> None:
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(  # type: ignore[call-overload]
        **kwargs, stream=True, stream_options={"include_usage": True}
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_stream_without_usage_option_has_no_usage_chunk(client: OpenAI) -> None:
    chunks = list(
        client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0, stream=True)
    )
    assert all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)


def test_prefix_cache_hits_show_as_cached_tokens(client: OpenAI) -> None:
    prompt = " ".join(["The sort method orders a list in place."] * 12)  # > several blocks
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert 0 < cached < second.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text


def test_seeded_sampling_is_reproducible(client: OpenAI) -> None:
    def sample(seed: int) -> str:
        resp = client.completions.create(
            model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, seed=seed
        )
        return resp.choices[0].text

    assert sample(7) == sample(7)


def test_stop_string_ends_the_text(client: OpenAI, engine: Engine) -> None:
    text, _ = engine_greedy(engine, PROMPTS[0], 16)
    stop = text.strip()[:2]
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop]
    )
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == text[: text.index(stop)]


def test_logprobs_and_echo(client: OpenAI, engine: Engine) -> None:
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    choice = resp.choices[0]
    assert choice.text.startswith(PROMPTS[0])
    num_prompt = len(engine.tokenizer.encode(PROMPTS[0]))
    # OpenAI's legacy echo: the prompt's tokens lead, the first with nothing to be scored by.
    assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == num_prompt + 4
    lp = choice.logprobs
    assert (lp.token_logprobs or [])[0] is None and (lp.top_logprobs or [])[0] is None
    rows = zip(lp.tokens or [], lp.token_logprobs or [], lp.top_logprobs or [], strict=True)
    for position, (token, logprob, top) in enumerate(rows):
        if position == 0:
            continue
        assert logprob is not None and logprob <= 0 and token in top
        if position >= num_prompt:  # greedy: the sampled token is the top one
            assert max(top.values()) == pytest.approx(logprob)


def test_models_and_probes(client: OpenAI, server: RuntimeServer) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ready").json() == {"status": "ready"}


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"prompt": "word " * 600}, "prompt"),
        ({"max_tokens": 600}, "max_tokens"),
        ({"prompt": [5000]}, "prompt"),
    ],
)
def test_bad_requests_are_400_naming_the_field(
    client: OpenAI, kwargs: dict[str, object], param: str
) -> None:
    request = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**request)  # type: ignore[call-overload]
    assert info.value.status_code == 400
    assert info.value.param == param, info.value.message


def test_malformed_json_and_wrong_types_are_400(server: RuntimeServer) -> None:
    url = f"{server.url}/v1/chat/completions"
    for content in (b"{not json", b"[]", b'{"model": "tiny", "messages": "hi"}', b"\xff\xfe"):
        response = httpx.post(url, content=content, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert "message" in response.json()["error"]
