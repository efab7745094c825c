"""Fixtures for the model-level runtime tests: the committed tiny-llama and its HF reference."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.reference.models import TINY_LLAMA
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.engine import Engine


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    return TINY_LLAMA


@pytest.fixture(scope="session")
def hf_tiny_llama() -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(TINY_LLAMA, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def make_engine() -> Callable[..., Engine]:
    def make(model: Path = TINY_LLAMA, **kwargs: Any) -> Engine:
        kwargs.setdefault("device", "cpu")
        # The references are float32 (hf_tiny_llama); `auto` would compute this bf16 checkpoint
        # in bf16 on a CPU with bf16 units and in float32 elsewhere, so the tests pin it.
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("max_model_len", 512)
        kwargs.setdefault("kv_cache_memory", 16 * 2**20)
        return Engine(EngineConfig(model=str(model), **kwargs))

    return make
