"""`--speculative-config` through the real server: the same greedy text as a server without it,
through the official openai client, with vLLM's acceptance metrics and /version saying what runs;
a bad config stops the server at start-up with one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.support.server_process import MODEL, TINY, RuntimeServer, free_port

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
# float32: a step checking proposals runs more rows than one without, and in bf16 another batch
# shape can flip a near-tied greedy token of tiny-llama (the texts are compared).
SERVER_ARGS = ("--max-model-len", "512", "--max-num-seqs", "4", "--dtype", "float32")
# A prompt that quotes itself, as a summary or a code edit does: prompt lookup proposes from it.
QUOTING = "The cat sat on the mat and the dog ran to the park. " * 3 + "The cat"


def greedy(server: RuntimeServer) -> str:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    done = client.completions.create(model=MODEL, prompt=QUOTING, max_tokens=48, temperature=0)
    return done.choices[0].text


@pytest.fixture(scope="module")
def plain(start_server: Callable[..., RuntimeServer]) -> RuntimeServer:
    return start_server(*SERVER_ARGS)


def test_speculative_server_gives_the_same_greedy_text_and_reports_acceptance(
    start_server: Callable[..., RuntimeServer], plain: RuntimeServer
) -> None:
    spec = start_server(*SERVER_ARGS, "--speculative-config", NGRAM)
    assert greedy(spec) == greedy(plain)
    metrics = spec.metrics()
    drafts = metrics["vllm:spec_decode_num_draft_tokens_total"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens_total"]
    assert metrics["vllm:spec_decode_num_drafts_total"] > 0 and 0 < accepted <= drafts
    assert metrics["kvpilot_spec_decode_accepted_tokens_total"] == accepted
    assert plain.metrics()["vllm:spec_decode_num_drafts_total"] == 0
    engine = httpx.get(f"{spec.url}/version", timeout=10).json()["engine"]
    assert engine["speculative"] == "ngram, up to 4 token(s), lookup 2-3"
    assert httpx.get(f"{plain.url}/version", timeout=10).json()["engine"]["speculative"] == "off"


def test_a_draft_model_server_gives_the_same_greedy_text(
    start_server: Callable[..., RuntimeServer], plain: RuntimeServer
) -> None:
    """tiny-llama as its own draft: nearly every proposal kept (a draft's catch-up runs other
    batch shapes than the check, so a near-tie may still differ)."""
    config = json.dumps({"method": "draft_model", "model": str(TINY), "num_speculative_tokens": 3})
    spec = start_server(*SERVER_ARGS, "--speculative-config", config)
    assert greedy(spec) == greedy(plain)
    metrics = spec.metrics()
    drafts = metrics["vllm:spec_decode_num_draft_tokens_total"]
    assert 0.8 * drafts <= metrics["vllm:spec_decode_num_accepted_tokens_total"] <= drafts
    engine = httpx.get(f"{spec.url}/version", timeout=10).json()["engine"]
    assert engine["speculative"] == f"draft_model, up to 3 token(s), draft {TINY}"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"method": "eagle"}', "unknown speculative method 'eagle'; supported: ngram"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "must be in [1, 16], got 99"),
        ('{"method": "draft_model"}', 'method "draft_model" needs "model"'),
        ("ngram", "--speculative-config is not JSON"),
        # From the draft's files, before the server starts (no weights read)
        ('{"method": "draft_model", "model": "/nonexistent"}', "/nonexistent does not exist"),
        ('{"method": "draft_model", "model": "OTHER"}', "has another tokenizer than the served"),
    ],
)
def test_a_bad_speculative_config_stops_the_server_at_start_up_in_one_line(
    config: str, message: str, tmp_path: Path
) -> None:
    config = config.replace("OTHER", str(other_tokenizer_model(tmp_path)))
    command = [sys.executable, "-m", "kvpilot.runtime.cli", "serve", "--model", str(TINY),
               "--port", str(free_port()), "--speculative-config", config]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert (
        result.stderr.strip() == f"kvpilot-runtime serve: {result.stderr.strip().split(': ', 1)[1]}"
    )
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def other_tokenizer_model(root: Path) -> Path:
    """tiny-llama with two tokens' ids swapped in its tokenizer: the same size, another map."""
    model = root / "other-tokenizer"
    shutil.copytree(TINY, model)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = "the", "and"
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    return model
