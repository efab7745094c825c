"""What a pre-quantised checkpoint's weights cost in memory, from its config.json alone.

The operator plans an AWQ, GPTQ or compressed-tensors checkpoint without its weights: the
runtime's own parser (checkpoint_quant.py) says which linear modules are quantised and how, and
the architecture says their shapes. The runtime holds them as its int4/int8 levels do (int4: two
values a byte plus a bf16 scale and zero per group; int8: one byte; fp8: dequantised at load to
the compute dtype) and everything else at 16 bits. A safetensors header's element count is no
parameter count here (eight int4 values share one int32), so parameters come from the shapes.
A Llama-family decoder is assumed (Llama, Mistral, Qwen2/3): what the runtime loads.
"""

from __future__ import annotations

import re
from typing import Any

from kvpilot.contract.checkpoint_quant import (
    FIELD,
    PACKED_INT4_METHODS,
    ROW_PARALLEL_MODULES,
    CheckpointQuant,
    WeightScheme,
    check_prequantized_parallel,
)
from kvpilot.contract.checkpoint_quant import parse_quantization_config as parse
from kvpilot.contract.memory import (
    INT4_GROUP_SIZE,
    SCALE_BYTES,
    CheckpointWeights,
    bytes_per_param,
)

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def read_checkpoint_weights(config: dict[str, Any]) -> CheckpointWeights | None:
    """None for a 16-bit checkpoint; ValueError naming the quantization_config field the
    runtime does not support (checkpoint_quant.parse_quantization_config's own message)."""
    quant = parse(config)
    if quant is None:
        return None
    quantized = [
        (shape, scheme)
        for name, shape in linear_modules(config)
        if (scheme := _scheme(quant, name, config[FIELD])) is not None
    ]
    return CheckpointWeights(
        level=quant.level,
        description=quant.describe(),
        kind=quant.kind,
        quantized_parameters=sum(n_in * n_out for (n_in, n_out), _ in quantized),
        quantized_bytes=sum(n_in * n_out * scheme_bytes(s) for (n_in, n_out), s in quantized),
        tensor_parallel_sizes=tensor_parallel_sizes(quant, config),
    )


# The degrees a checkpoint is checked for: the planner's (planner.TP_DEGREES); a degree missing
# here is never planned for a pre-quantised checkpoint.
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)


def tensor_parallel_sizes(quant: CheckpointQuant, config: dict[str, Any]) -> tuple[int, ...]:
    """The degrees the runtime splits the checkpoint into, by its own check with the row-parallel
    modules' inputs (o_proj, down_proj) from the config's shapes."""
    inputs = {
        name: n_in for name, (n_in, _) in linear_modules(config)
        if name.rsplit(".", 1)[-1] in ROW_PARALLEL_MODULES
    }  # fmt: skip
    return tuple(tp for tp in TENSOR_PARALLEL_SIZES if _splits(quant, tp, inputs))


def _splits(quant: CheckpointQuant, tensor_parallel_size: int, inputs: dict[str, int]) -> bool:
    try:
        check_prequantized_parallel(quant, tensor_parallel_size, inputs)
    except ValueError:
        return False
    return True


def _scheme(quant: CheckpointQuant, module: str, qc: dict[str, Any]) -> WeightScheme | None:
    """The module's scheme as the runtime reads it. GPTQ/AWQ pack every linear module but
    AWQ's `modules_to_not_convert` (a substring, as transformers matches them) and GPTQModel's
    `dynamic` `-:<regex>` skips (the only entries the parser accepts); the lm_head where their
    `lm_head` is true (scheme_for says)."""
    if quant.method not in PACKED_INT4_METHODS:
        return quant.scheme_for(module)
    skipped = qc.get("modules_to_not_convert") or ()
    skip_patterns = [str(p)[2:] for p in qc.get("dynamic") or {} if str(p).startswith("-:")]
    if any(s in module for s in skipped) or any(re.match(p, module) for p in skip_patterns):
        return None
    return quant.scheme_for(module)


def scheme_bytes(scheme: WeightScheme) -> float:
    """Bytes per parameter of a quantised module as the runtime stores it."""
    if scheme.type == "float":
        return bytes_per_param("bf16")  # dequantised at load: no fp8 matmul on the CPU path
    if scheme.num_bits == 8:
        return bytes_per_param("int8")
    group = scheme.group_size or INT4_GROUP_SIZE  # one scale per row: repeated per group of 128
    return 0.5 + 2 * SCALE_BYTES / group


def linear_modules(config: dict[str, Any]) -> list[tuple[str, tuple[int, int]]]:
    """Every linear module's name and (input, output) width, lm_head included when untied."""
    hidden, query, kv, inter = _widths(config)
    shapes = {
        "q_proj": (hidden, query),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (query, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    modules = [
        (f"model.layers.{i}.{'self_attn' if m in _ATTENTION else 'mlp'}.{m}", shapes[m])
        for i in range(int(config["num_hidden_layers"]))
        for m in (*_ATTENTION, *_MLP)
    ]
    if not config.get("tie_word_embeddings", False):
        modules.append(("lm_head", (hidden, int(config["vocab_size"]))))
    return modules


def architecture_parameters(config: dict[str, Any]) -> int:
    """All parameters by the shapes: linear modules, embeddings, norms (and Qwen2's q/k/v
    biases, Qwen3's q/k norms)."""
    hidden, query, kv, _ = _widths(config)
    layers, model_type = int(config["num_hidden_layers"]), config.get("model_type", "")
    per_layer = 2 * hidden  # input and post-attention norms
    if config.get("attention_bias", model_type == "qwen2"):
        per_layer += query + 2 * kv
    if model_type == "qwen3":
        per_layer += 2 * (query // int(config["num_attention_heads"]))
    linear = sum(n_in * n_out for _, (n_in, n_out) in linear_modules(config))
    return linear + int(config["vocab_size"]) * hidden + layers * per_layer + hidden


def _widths(config: dict[str, Any]) -> tuple[int, int, int, int]:
    """(hidden, query, key/value, MLP) widths."""
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return hidden, heads * head_dim, kv_heads * head_dim, int(config["intermediate_size"])
