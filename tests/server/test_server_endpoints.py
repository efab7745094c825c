"""/tokenize, /detokenize, /version, unknown models (404 model_not_found) and endpoints the server
does not have, on a real server."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine import machine_files
from kvpilot.runtime.layers import paged_kernel
from kvpilot.runtime.models.loader import load_model_config
from kvpilot.runtime.models.tokenizer_files import Tokenizer
from tests.support.server_process import MODEL, TINY, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What does the sort method do?"},
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(TINY)


@pytest.fixture(scope="module")
def client(server: RuntimeServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def post(server: RuntimeServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def test_tokenize_a_prompt_as_the_tokenizer_does(server: RuntimeServer, tok: Tokenizer) -> None:
    text = "def main():\n    return sorted(items)"
    answer = post(server, "/tokenize", {"model": MODEL, "prompt": text}).json()
    assert answer["tokens"] == tok.encode(text)
    assert answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == 512
    assert answer.get("token_strs") is None
    bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False)
    assert bare["tokens"] != answer["tokens"]  # tiny-llama's tokenizer adds BOS


def test_tokenize_strings_are_the_vocabulary_entries(server: RuntimeServer) -> None:
    answer = post(server, "/tokenize", {"prompt": "the list", "return_token_strs": True}).json()
    assert len(answer["token_strs"]) == answer["count"]
    assert "Ġlist" in answer["token_strs"]  # byte-level BPE: a leading space is 'Ġ'


def test_tokenize_messages_counts_what_chat_completions_bill(
    server: RuntimeServer, client: OpenAI
) -> None:
    for add_generation_prompt in (True, False):
        body = {"messages": MESSAGES, "add_generation_prompt": add_generation_prompt}
        answer = post(server, "/tokenize", body).json()
        chat = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=1,
            extra_body={"add_generation_prompt": add_generation_prompt},
        )
        assert chat.usage is not None
        assert answer["count"] == chat.usage.prompt_tokens


def test_detokenize_inverts_tokenize(server: RuntimeServer) -> None:
    text = "Return a new list, sorted."
    ids = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert post(server, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [5, 4096]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {}, "tokens"),
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, None),
        ("/tokenize", {"messages": []}, "messages"),
    ],
)
def test_bad_tokenize_bodies_are_400(
    server: RuntimeServer, path: str, body: dict[str, Any], param: str | None
) -> None:
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    if param is None:
        assert "exactly one of `prompt`" in error["message"]


def test_version_is_the_package_version_and_the_choices_for_this_machine(
    server: RuntimeServer,
) -> None:
    """The server was started with none of --threads, --dtype or --kv-cache-memory: /version
    reports what it chose from this machine, as the same probes read here decide."""
    answer = httpx.get(f"{server.url}/version").json()
    assert answer["version"] == importlib.metadata.version("kvpilot")
    engine = answer["engine"]
    threads = machine_files.thread_choice(None)
    assert (engine["threads"], engine["threads_source"]) == (threads.num_threads, threads.source)
    has_bf16 = machine_files.cpu_supports_bf16()
    assert engine["cpu_has_bf16"] is has_bf16
    # --int8-kernel auto: w8a8 where the CPU has int8 dot products (reported whatever the level)
    has_int8_dot = machine_files.cpu_supports_int8_dot()
    assert engine["cpu_has_int8_dot"] is has_int8_dot
    assert engine["int8_kernel"] == ("w8a8" if has_int8_dot else "w8a16")
    assert engine["quantization"] == "none"
    # --attention-backend auto: the paged kernel on CPU where it builds (make setup builds it)
    assert engine["attention_backend"] == (
        "paged" if paged_kernel.unavailable_reason() is None else "sdpa"
    )
    assert engine["attention_source"]
    # tiny-llama is a bf16 checkpoint: bf16 compute where the CPU has bf16 units
    assert engine["dtype"] == ("bfloat16" if has_bf16 else "float32")
    assert engine["kv_cache_dtype"] == engine["dtype"]
    # --max-num-seqs 8 x --max-model-len 512 fit easily: the pool is exactly what they can fill
    cfg = load_model_config(TINY)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (2 if has_bf16 else 4)
    assert engine["kv_cache_bytes"] == 8 * 512 * per_token
    assert engine["kv_cache_blocks"] == 8 * 512 // BLOCK_SIZE
    assert engine["kv_cache_source"].startswith("max_num_seqs x max_model_len, under 0.9 of ")


def test_unknown_model_is_404_model_not_found(client: OpenAI, server: RuntimeServer) -> None:
    calls = [
        lambda: client.completions.create(model="gpt-4", prompt="hi", max_tokens=1),
        lambda: client.chat.completions.create(
            model="gpt-4",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=1,
        ),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.code == "model_not_found"
        assert info.value.param == "model"
        assert MODEL in info.value.message  # says which model to use instead
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/tokenize", {"prompt": "a"}),
        ("/detokenize", {"tokens": [1]}),
    ]
    for path, body in bodies:
        response = post(server, path, {**body, "model": "gpt-4"})
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"


def test_an_api_the_server_lacks_is_a_404_naming_the_endpoints_it_has(
    client: OpenAI, server: RuntimeServer
) -> None:
    calls = [
        lambda: client.embeddings.create(model=MODEL, input="hi"),
        lambda: client.responses.create(model=MODEL, input="hi", max_output_tokens=1),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert "is not an endpoint of this server; its OpenAI endpoints: " in info.value.message
        assert "POST /v1/chat/completions, POST /v1/completions, GET /v1/models" in (
            info.value.message
        )
    wrong_method = httpx.get(f"{server.url}/v1/completions", timeout=10)
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["message"] == (
        "GET /v1/completions is not served; use POST /v1/completions"
    )
