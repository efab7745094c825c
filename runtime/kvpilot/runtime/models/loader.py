"""Reading a Hugging Face model directory: config, safetensors weights, tokenizer files.

Supported: Llama (incl. Llama-3 RoPE scaling), Qwen2 (q/k/v bias), Qwen3 dense (per-head q/k
RMSNorm), Mistral; 16-bit or pre-quantised (contract/checkpoint_quant.py says which schemes).
Everything else, and every missing file, is a clear error naming what is supported or missing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvpilot.contract.checkpoint_quant import CheckpointQuant, parse_quantization_config

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# Architectures whose attention RMS-normalises each q and k head before RoPE (`q_norm`, `k_norm`).
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    has_qkv_bias: bool
    torch_dtype: str  # the checkpoint's dtype name
    sliding_window: int | None = None
    has_qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k, weights [head_dim] each
    # A pre-quantised checkpoint's quantization_config, checked (contract/checkpoint_quant.py).
    checkpoint_quant: CheckpointQuant | None = None

    @property
    def num_parameters(self) -> int:
        """Parameters stored (tied embeddings once), for the shared memory arithmetic."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * self.num_heads * self.head_dim * 2 + h * kv * 2
        attn += (self.num_heads * self.head_dim + 2 * kv) if self.has_qkv_bias else 0
        attn += 2 * self.head_dim if self.has_qk_norm else 0
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + h


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"missing {path.name} in {path.parent}")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def load_model_config(model_dir: Path) -> ModelConfig:
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    cfg = read_json(model_dir / "config.json")
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    num_heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    rope_scaling = cfg.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        has_qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        sliding_window=window,
        has_qk_norm=arch in _QK_NORM_ARCHITECTURES,
        checkpoint_quant=parse_quantization_config(cfg),
    )


def resolve_dtype(
    name: str, checkpoint_dtype: str, device: torch.device, cpu_has_bf16: bool = False
) -> torch.dtype:
    """`auto` keeps the checkpoint's dtype on CUDA. On CPU it computes a 16-bit checkpoint in
    bfloat16 where the CPU has bf16 units (`cpu_has_bf16`: AVX512-BF16 or AMX; float16 too,
    whose CPU kernels are slow) and widens to float32 where it has none, since there every bf16
    matmul would be converted first; a float32 checkpoint stays float32."""
    if name == "auto":
        if device.type == "cpu":
            is_16_bit = checkpoint_dtype in ("bfloat16", "float16")
            return torch.bfloat16 if cpu_has_bf16 and is_16_bit else torch.float32
        name = checkpoint_dtype if checkpoint_dtype in _DTYPES else "bfloat16"
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, single or sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index)["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise FileNotFoundError(f"missing weight shard(s) {', '.join(missing)} in {model_dir}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir} "
        "(only safetensors checkpoints are supported)"
    )


@contextmanager
def open_weights(model_dir: Path) -> Iterator[Callable[[str], torch.Tensor | None]]:
    """A reader of checkpoint tensors by name (None if absent), one tensor at a time on demand:
    a tensor-parallel rank that keeps a shard of each never holds the whole checkpoint."""
    with ExitStack() as stack:
        files: dict[str, Any] = {}
        for path in weight_files(model_dir):
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            files.update(dict.fromkeys(handle.keys(), handle))
        yield lambda name: files[name].get_tensor(name) if name in files else None
