"""How the engine sizes itself: its device, the model facts that size the KV cache, and the
longest context it serves. Pure functions of the config and the checkpoint's config.json."""

from __future__ import annotations

import torch

from kvpilot.runtime import memory
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.loader import ModelConfig


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


def model_facts(cfg: ModelConfig) -> memory.ModelFacts:
    return memory.ModelFacts(
        parameters=cfg.num_parameters,
        layers=cfg.num_layers,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
    )


def resolve_max_model_len(config: EngineConfig, cfg: ModelConfig) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:  # full attention equals sliding-window attention inside the window
        limit = min(limit, cfg.sliding_window)
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit {limit}")
    return config.max_model_len or limit
