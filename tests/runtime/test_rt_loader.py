"""Checkpoint loading: sharded safetensors, and a clear error for each unsupported input."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def greedy(engine: Engine, prompt: str) -> list[int]:
    engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0), "r")
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_like_the_single_file(
    tiny_llama_dir: Path, make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    # A fresh copy: converting the shared fixture would round its rotary buffers to bf16.
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    model.save_pretrained(sharded, max_shard_size="2MB")
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_llama_dir / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) >= 3
    prompt = "The with statement"
    assert greedy(make_engine(sharded), prompt) == greedy(make_engine(), prompt)


def edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def break_arch(path: Path) -> None:
    edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")


def break_rope(path: Path) -> None:
    edit_config(path, rope_scaling={"rope_type": "yarn", "factor": 4.0})


def break_tensor(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def break_shard(path: Path) -> None:
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("breakage", "error", "message"),
    [
        (lambda p: (p / "config.json").unlink(), FileNotFoundError, "missing config.json"),
        (break_arch, ValueError, "unsupported architecture.*supported: LlamaForCausalLM"),
        (lambda p: (p / "model.safetensors").unlink(), FileNotFoundError, "no model.safetensors"),
        (break_shard, FileNotFoundError, "missing weight shard.*model-00002-of-00002"),
        (break_tensor, ValueError, "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
        (lambda p: (p / "tokenizer.json").unlink(), FileNotFoundError, "missing tokenizer.json"),
        (break_rope, ValueError, "unsupported rope_scaling type 'yarn'"),
    ],
    ids=["config", "architecture", "weights", "shard", "tensor", "tokenizer", "rope"],
)
def test_clear_errors(
    tiny_llama_dir: Path,
    make_engine: Callable[..., Engine],
    tmp_path: Path,
    breakage: Callable[[Path], Any],
    error: type[Exception],
    message: str,
) -> None:
    model = copy_model(tiny_llama_dir, tmp_path / "m")
    breakage(model)
    with pytest.raises(error, match=message):
        make_engine(model)


def test_missing_directory(make_engine: Callable[..., Engine], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_engine(tmp_path / "nope")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_model_len": 4096}, "max_model_len 4096 exceeds the model's limit 2048"),
        (
            {"kv_cache_memory": 100_000},
            "holds 3 blocks; one sequence of max_model_len 512 needs 32",
        ),
    ],
)
def test_engine_config_errors(
    make_engine: Callable[..., Engine], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine(**kwargs)
