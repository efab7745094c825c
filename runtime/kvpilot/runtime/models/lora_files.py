"""Reading a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) and
checking it against the base model it is to run on.

What is read is exactly what the runtime applies: for each targeted projection of each layer,
A [r, in] and B [out, r] with the scaling (lora_alpha / r, or / sqrt(r) with use_rslora) folded
into B. What PEFT can express and the runtime does not apply (DoRA, modules_to_save, trained
biases, per-module ranks) is refused with an error naming the field, never silently ignored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvpilot.runtime.models.loader import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
# PEFT's key: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraError(ValueError):
    """An adapter that cannot be served, with what is wrong and what to do."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights on the host, ready to copy into a slot."""

    path: str
    rank: int
    # (layer, module) -> (A [r, in], B [out, r] with the scaling folded in), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.weights})

    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of a base projection, as the checkpoint stores it."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }
    return shapes[module]


def lora_scaling(config: dict[str, Any], rank: int) -> float:
    alpha = float(config.get("lora_alpha", rank))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def check_config(config: dict[str, Any], max_rank: int) -> int:
    """The adapter's rank, after refusing what the runtime does not apply."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"peft_type {config.get('peft_type')!r} is not supported; only LORA")
    refused = {
        "use_dora": "DoRA (use_dora) is not supported; merge or retrain without it",
        "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "layers_to_transform": "layers_to_transform is not supported; target every layer",
    }
    for name, message in refused.items():
        if config.get(name):
            raise LoraError(f"adapter_config.json field {name}: {message}")
    if config.get("bias", "none") != "none":
        raise LoraError(
            f"adapter_config.json field bias: {config['bias']!r} (trained biases) is not "
            "supported; only 'none'"
        )
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoraError(f"adapter_config.json field r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(
            f"adapter rank r={rank} is above --max-lora-rank {max_rank}; raise --max-lora-rank "
            "or use an adapter of a lower rank"
        )
    return rank


def read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoraError(f"{path} has no {CONFIG_FILE}: not a PEFT adapter directory")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoraError(f"{file} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise LoraError(f"{file} must hold a JSON object")
    return config


def load_adapter(path: str, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check an adapter directory; LoraError for anything that would not run."""
    directory = Path(path)
    config = read_config(directory)
    rank = check_config(config, max_rank)
    weights_file = directory / WEIGHTS_FILE
    if not weights_file.is_file():
        raise LoraError(f"{directory} has no {WEIGHTS_FILE} (only safetensors weights are read)")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            layer, module, which = _parse_key(key, cfg)
            pairs.setdefault((layer, module), {})[which] = f.get_tensor(key).float()
    if not pairs:
        raise LoraError(f"{weights_file} holds no lora_A/lora_B weights")
    scaling = lora_scaling(config, rank)
    weights = {}
    for (layer, module), pair in pairs.items():
        a, b = _check_pair(layer, module, pair, cfg, rank)
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    return LoraAdapter(str(directory), rank, weights)


def _parse_key(key: str, cfg: ModelConfig) -> tuple[int, str, str]:
    match = _KEY.search(key)
    if match is None:
        raise LoraError(
            f"adapter tensor {key!r} is not a LoRA A/B weight of a decoder layer's projection; "
            f"supported target modules: {', '.join(SUPPORTED_MODULES)}"
        )
    layer, module, which = int(match[1]), match[2], match[3]
    if module not in SUPPORTED_MODULES:
        raise LoraError(
            f"adapter targets module {module!r}, which the model lacks or the runtime does not "
            f"adapt; supported target modules: {', '.join(SUPPORTED_MODULES)}"
        )
    if layer >= cfg.num_layers:
        raise LoraError(
            f"adapter targets layer {layer} ({key}); the base model has {cfg.num_layers} layers"
        )
    return layer, module, which


def _check_pair(
    layer: int, module: str, pair: dict[str, torch.Tensor], cfg: ModelConfig, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    name = f"layers.{layer}.{module}"
    if set(pair) != {"A", "B"}:
        raise LoraError(f"{name} has lora_{''.join(pair)} but not both lora_A and lora_B")
    a, b = pair["A"], pair["B"]
    out_features, in_features = module_shape(cfg, module)
    expected_a, expected_b = (rank, in_features), (out_features, rank)
    if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise LoraError(
            f"{name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the base "
            f"model, which needs {list(expected_a)} and {list(expected_b)} at rank {rank} "
            "(an adapter trained for another base model?)"
        )
    return a, b
