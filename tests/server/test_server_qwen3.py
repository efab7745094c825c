"""A Qwen3 checkpoint served by a real `kvpilot-runtime serve`: the official openai client's
greedy completion equals transformers' Qwen3ForCausalLM, and /metrics describes its KV pool."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from bench.reference.models import QWEN3_PROMPTS, hf_greedy, qwen3_checkpoint
from kvpilot.runtime.models.tokenizer_files import Tokenizer
from tests.support.server_process import MODEL, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def qwen3_server(
    start_server: Callable[..., RuntimeServer], tmp_path_factory: pytest.TempPathFactory
) -> tuple[RuntimeServer, Path, Any]:
    path = tmp_path_factory.mktemp("qwen3")
    hf_model = qwen3_checkpoint(path, tied=True)
    server = start_server("--model", str(path), "--max-model-len", "256", "--dtype", "float32")
    return server, path, hf_model


def test_served_qwen3_completes_as_transformers_does(
    qwen3_server: tuple[RuntimeServer, Path, Any],
) -> None:
    server, path, hf_model = qwen3_server
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    tokenizer = Tokenizer(path)
    for prompt in QWEN3_PROMPTS:
        completion = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        expected = hf_greedy(hf_model, prompt, MAX_TOKENS)
        assert completion.usage is not None and completion.usage.completion_tokens == MAX_TOKENS
        assert completion.choices[0].text == tokenizer.decode(expected)


def test_metrics_describe_the_qwen3_pool(qwen3_server: tuple[RuntimeServer, Path, Any]) -> None:
    server, _, _ = qwen3_server
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    line = next(row for row in text.splitlines() if row.startswith("vllm:cache_config_info{"))
    blocks = server.metrics()["kvpilot_kv_cache_total_blocks"]
    assert f'num_gpu_blocks="{int(blocks)}"' in line and blocks > 0
