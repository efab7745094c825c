"""bench/gpu/random_checkpoint.py: the no-network 8B-shaped checkpoint of the serving benchmark,
checked at the tiny shape on CPU: transformers loads it as a Llama, the engine serves it with the
same greedy tokens, every token id decodes, and prompts of token ids are written as asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.gpu.random_checkpoint import (
    LLAMA_31_8B,
    TINY,
    special_ids,
    tensor_shapes,
    write_random_checkpoint,
)
from bench.gpu.serve_throughput import num_requests, token_prompts
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.models.tokenizer_files import Tokenizer

pytestmark = pytest.mark.slow  # loads a model twice


def test_the_8b_shape_holds_llama_31_8bs_parameter_count() -> None:
    num_parameters = sum(torch.Size(size).numel() for size in tensor_shapes(LLAMA_31_8B).values())
    assert num_parameters == 8_030_261_248  # Llama-3.1-8B's, as its model card counts them


def test_tiny_checkpoint_loads_in_transformers_and_the_engine_alike(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = write_random_checkpoint(tmp_path / "model", TINY, "cpu", seed=3)
    prompt = [5, 77, 300, 12, 9, 411]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False
        )
    expected = out[0, len(prompt) :].tolist()
    config = EngineConfig(
        model=str(path), device="cpu", dtype="float32", max_model_len=256,
        kv_cache_memory=4 * 2**20,
    )  # fmt: skip
    engine = Engine(config)
    engine.add_request(prompt, SamplingParams(max_tokens=12, min_tokens=12, temperature=0), "a")
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == expected
    assert len(set(expected)) > 1  # random weights, yet not one token repeated for ever
    tokenizer = Tokenizer(path)
    assert tokenizer.eos_token_ids == [special_ids(TINY["vocab_size"])[1]]
    assert tokenizer.decode([300, 301]) == "t300t301"
    text_ids = tokenizer.encode("hi there", add_special_tokens=False)  # byte by byte
    assert len(text_ids) == 8 and tokenizer.decode(text_ids) == "hi there"
    assert tokenizer.decode(expected)  # whatever the model drew decodes
    assert write_random_checkpoint(path, TINY) == path  # made once: a second call reuses it


def test_token_prompts_are_random_ids_of_the_asked_length(tmp_path: Path) -> None:
    dataset = token_prompts(tmp_path / "p.jsonl", num_requests(1), 30, 7, vocab=512, seed=1)
    records = [json.loads(line) for line in dataset.read_text().splitlines()]
    assert len(records) == 2  # at least 2 requests even at concurrency 1
    assert all(len(r["prompt"]) == 30 and r["max_tokens"] == 7 for r in records)
    ids = [t for r in records for t in r["prompt"]]
    assert min(ids) >= 0 and max(ids) < min(special_ids(512))
    assert records[0]["prompt"] != records[1]["prompt"]  # no shared prefix to flatter the cache
