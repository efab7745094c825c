"""n > 1 choices and several prompts per request, with the official openai client."""

from __future__ import annotations

from collections import defaultdict

import pytest
from openai import OpenAI

from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.models.tokenizer_files import Tokenizer
from tests.support.server_process import MODEL, TINY, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

TOKENIZER = Tokenizer(TINY)
HITS = "kvpilot_prefix_cache_hits_total"


@pytest.fixture(scope="module")
def client(server: RuntimeServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def long_prompt(topic: str) -> str:
    """A prompt of several KV blocks that no other test sends."""
    return " ".join([f"The {topic} method orders a list in place."] * 8)


def test_n_choices_share_the_prompt_through_the_prefix_cache(
    client: OpenAI, server: RuntimeServer
) -> None:
    prompt = long_prompt("shared")
    num_prompt = len(TOKENIZER.encode(prompt))
    hits_before = server.metrics()[HITS]
    resp = client.completions.create(
        model=MODEL, prompt=prompt, n=4, max_tokens=10, temperature=1.0, seed=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    cached = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    # Three of the four sequences read the prompt from the cache: it was computed once.
    assert server.metrics()[HITS] - hits_before == 3 * cached
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert len({c.text for c in resp.choices}) == 4
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == num_prompt  # the prompt counts once, as OpenAI's
    assert resp.usage.completion_tokens == 40


def test_choice_j_draws_with_seed_plus_j(client: OpenAI) -> None:
    def texts(n: int, seed: int) -> list[str]:
        resp = client.completions.create(
            model=MODEL, prompt="Return a new", n=n, max_tokens=8, temperature=1.0, seed=seed
        )
        return [c.text for c in resp.choices]

    assert texts(3, 20) == texts(1, 20) + texts(1, 21) + texts(1, 22)


def test_several_prompts_are_prompt_major(client: OpenAI) -> None:
    prompts = ["The list", "def main():\n    return"]
    singles = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        for p in prompts
    ]
    batch = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    expected = [s.choices[0].text for s in singles for _ in range(2)]
    assert [c.text for c in batch.choices] == expected
    usages = [s.usage for s in singles]
    assert batch.usage is not None and usages[0] is not None and usages[1] is not None
    assert batch.usage.prompt_tokens == usages[0].prompt_tokens + usages[1].prompt_tokens
    assert batch.usage.completion_tokens == 2 * (
        usages[0].completion_tokens + usages[1].completion_tokens
    )


def test_token_id_prompts_and_echo_per_prompt(client: OpenAI) -> None:
    ids = [TOKENIZER.encode("The list"), TOKENIZER.encode("Return a new")]
    resp = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True
    )
    for choice, prompt_ids in zip(resp.choices, ids, strict=True):
        assert choice.text.startswith(TOKENIZER.decode(prompt_ids))


def test_streamed_choices_equal_the_whole_response(client: OpenAI) -> None:
    fields = {"model": MODEL, "n": 3, "max_tokens": 12, "temperature": 1.0, "seed": 9}
    prompt = long_prompt("streamed")
    whole = client.completions.create(prompt=prompt, **fields)  # type: ignore[call-overload]
    texts: dict[int, str] = defaultdict(str)
    reasons: dict[int, str | None] = {}
    usage = None
    for chunk in client.completions.create(
        prompt=prompt, stream=True, stream_options={"include_usage": True}, **fields
    ):  # type: ignore[call-overload]
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
        usage = chunk.usage or usage
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]
    assert [reasons[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_chat_n_choices_streamed_and_whole(client: OpenAI) -> None:
    fields = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What does the sort method do?"}],
        "n": 2,
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 4,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**fields)  # type: ignore[call-overload]
    assert [c.index for c in whole.choices] == [0, 1]
    texts: dict[int, str] = defaultdict(str)
    roles: set[int] = set()
    for chunk in client.chat.completions.create(stream=True, **fields):  # type: ignore[call-overload]
        for choice in chunk.choices:
            if choice.delta.role == "assistant":
                roles.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
    assert roles == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    single = client.chat.completions.create(**{**fields, "n": 1})  # type: ignore[call-overload]
    assert whole.usage.completion_tokens == 20  # both choices' tokens
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt once
