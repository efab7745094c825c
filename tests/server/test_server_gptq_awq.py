"""`kvpilot-runtime serve` on a GPTQ act-order checkpoint GPTQModel wrote: the official client
gets transformers' greedy text on the same checkpoint dequantised by GPTQModel, and /version
says what was loaded (issue 39)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from bench.reference.gptq_awq import dequantized_model
from bench.reference.models import hf_greedy
from kvpilot.runtime.models.tokenizer_files import Tokenizer
from tests.support.prequant_reference import gptqmodel_checkpoint
from tests.support.server_process import MODEL, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

PROMPT = "The for statement"


@pytest.fixture(scope="module")
def gptq_checkpoint() -> Path:
    return gptqmodel_checkpoint("gptq-g64-desc")


def test_gptq_checkpoint_serves_transformers_greedy_text(
    start_server: Callable[..., RuntimeServer], gptq_checkpoint: Path
) -> None:
    server = start_server(
        "--model", str(gptq_checkpoint), "--max-model-len", "256", "--dtype", "float32"
    )  # fmt: skip
    # float32: the reference computes in float32; bf16 compute would pick near-ties otherwise
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    tokenizer = Tokenizer(gptq_checkpoint)
    expected = hf_greedy(dequantized_model(gptq_checkpoint), tokenizer.encode(PROMPT), 12)
    assert completion.choices[0].text == tokenizer.decode(expected)
    engine = httpx.get(f"{server.url}/version", timeout=10).json()["engine"]
    assert engine["checkpoint_quantization"] == "gptq int4 (gptq, group 64, desc_act)"
