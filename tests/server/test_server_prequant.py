"""`kvpilot-runtime serve` on pre-quantised checkpoints: one compressed-tensors int4 checkpoint
answers the official client and says what it loaded; a scheme the loader does not read exits
at start with the field named (issue 39: it used to answer with the scales ignored)."""

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

from bench.reference.models import hf_greedy
from bench.reference.prequantized import decompressed_model, write_checkpoint
from kvpilot.runtime.models.tokenizer_files import Tokenizer
from tests.support.server_process import MODEL, RuntimeServer, free_port

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

PROMPT = "The for statement"


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("int4-g128"), "int4-g128")


def test_int4_checkpoint_serves_transformers_greedy_text(
    start_server: Callable[..., RuntimeServer], int4_checkpoint: Path
) -> None:
    server = start_server(
        "--model", str(int4_checkpoint), "--max-model-len", "256", "--dtype", "float32"
    )  # fmt: skip
    # float32: the reference computes in float32; bf16 compute would pick near-ties otherwise
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    tokenizer = Tokenizer(int4_checkpoint)
    expected = hf_greedy(decompressed_model(int4_checkpoint), tokenizer.encode(PROMPT), 12)
    assert completion.choices[0].text == tokenizer.decode(expected)
    engine = httpx.get(f"{server.url}/version", timeout=10).json()["engine"]
    assert engine["checkpoint_quantization"] == (
        "compressed-tensors int4 (pack-quantized, group 128)"
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("quant_method", "bitsandbytes",
         'quantization_config.quant_method: "bitsandbytes" is not supported; supported: '
         "compressed-tensors, gptq, awq"),
        ("config_groups.group_0.weights.num_bits", 3,
         "quantization_config.config_groups.group_0.weights.num_bits: 3 is not supported"),
    ],
)  # fmt: skip
def test_unsupported_checkpoint_exits_with_the_field_named(
    int4_checkpoint: Path, tmp_path: Path, field: str, value: object, message: str
) -> None:
    model = tmp_path / "model"
    shutil.copytree(int4_checkpoint, model)
    config = json.loads((model / "config.json").read_text())
    node = config["quantization_config"]
    *parents, last = field.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    (model / "config.json").write_text(json.dumps(config))
    command = [sys.executable, "-m", "kvpilot.runtime.cli", "serve", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(free_port())]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 1
    assert f"cannot load model {model}" in result.stderr and message in result.stderr
