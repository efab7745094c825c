"""Pre-quantised tiny-llama checkpoints written by compressed-tensors itself, and their reference.

`write_checkpoint` quantises tiny-llama's linear layers round-to-nearest (weight scales from each
channel's or group's min/max, compressed-tensors' `calculate_qparams`), compresses them with
compressed-tensors' `ModelCompressor` in the scheme's format and saves config.json with its
`quantization_config`, as llm-compressor would. The lm_head is left out (`ignore`), as
llm-compressor's recipes do, except in the `-head` variants: those quantise it too, and since
tiny-llama ties it to the embedding they untie the model first, as llm-compressor does when its
targets take in the lm_head (`untie_word_embeddings`: the embedding stays 16-bit, the lm_head is
a copy of it, quantised, and config.json says `tie_word_embeddings: false`).
`decompressed_model` is the reference: the same checkpoint decompressed by compressed-tensors' own
compressors into transformers' Llama (float32), which is also what transformers' loader does;
transformers 5.24 cannot load an asymmetric pack-quantized checkpoint itself (its zero point's
packed shape is refused as a size mismatch).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from bench.reference.models import TINY_LLAMA

# Group sizes 32/64/128 do not divide tiny-llama's 688 MLP features, which compressed-tensors
# refuses for down_proj: those schemes leave it out (an `ignore` entry, as llm-compressor advises).
DOWN_PROJ = "re:.*down_proj"
VARIANTS: dict[str, dict[str, Any]] = {
    "fp8-channel": dict(type="float", num_bits=8, strategy="channel", format="float-quantized"),
    "fp8-tensor-dynamic": dict(
        type="float", num_bits=8, strategy="tensor", format="float-quantized", activations=True
    ),
    "int4-g128": dict(num_bits=4, strategy="group", group_size=128, ignore=[DOWN_PROJ]),
    "int4-g64-asym": dict(
        num_bits=4, strategy="group", group_size=64, symmetric=False, ignore=[DOWN_PROJ]
    ),
    "int4-g32-asym": dict(
        num_bits=4, strategy="group", group_size=32, symmetric=False, ignore=[DOWN_PROJ]
    ),
    "int4-channel": dict(num_bits=4, strategy="channel"),
    # Every linear layer, for models whose features divide by 128 (bench.engine_prequant).
    "int4-g128-all": dict(num_bits=4, strategy="group", group_size=128),
    "int8-channel": dict(num_bits=8, strategy="channel"),
    # The lm_head quantised too (the model untied first).
    "int4-channel-head": dict(num_bits=4, strategy="channel", lm_head=True),
    "int4-g32-asym-head": dict(
        num_bits=4,
        strategy="group",
        group_size=32,
        symmetric=False,
        ignore=[DOWN_PROJ],
        lm_head=True,
    ),
    "int8-channel-head": dict(num_bits=8, strategy="channel", lm_head=True),
    "int4-g128-all-head": dict(num_bits=4, strategy="group", group_size=128, lm_head=True),
}
COMPUTE_BOUND_ONLY = ("int4-g128-all", "int4-g128-all-head")  # 688 MLP features: no group of 128
TINY_LLAMA_VARIANTS = [name for name in VARIANTS if name not in COMPUTE_BOUND_ONLY]


def write_checkpoint(out: Path, variant: str, source: Path = TINY_LLAMA) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import AutoModelForCausalLM

    spec = dict(VARIANTS[variant])
    fmt = spec.pop("format", "pack-quantized")
    lm_head = spec.pop("lm_head", False)
    ignore = [*([] if lm_head else ["lm_head"]), *spec.pop("ignore", [])]
    activations = spec.pop("activations", False)
    weights = QuantizationArgs(**spec)
    inputs = (
        QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True)
        if activations
        else None
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    if lm_head:
        _untie_word_embeddings(model)
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            _set_qparams(module)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)
    return out


def _untie_word_embeddings(model: Any) -> None:
    """What llm-compressor does before it quantises a tied lm_head: each of the embedding and
    the lm_head gets its own copy of the matrix, and the config says they are no longer tied."""
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        module.weight = torch.nn.Parameter(module.weight.data.clone(), requires_grad=False)
    model.config.tie_word_embeddings = False


def _set_qparams(module: Any) -> None:
    """Round-to-nearest scales (and zero points) from the weight's min/max, per channel, group
    or tensor, as an llm-compressor min-max observer computes them."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    w = module.weight.detach().float()
    if args.strategy == "group":
        w = torch.nn.functional.pad(w, (0, -w.shape[1] % args.group_size))
        w = w.unflatten(1, (-1, args.group_size))
        low, high = w.amin(2), w.amax(2)
    elif args.strategy == "channel":
        low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        low, high = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero = calculate_qparams(low.clamp(max=0), high.clamp(min=0), args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))


def decompressed_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, each quantised module's weight decompressed by
    compressed-tensors' compressor for its format."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    qc = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(qc)
    scheme = next(iter(config.config_groups.values()))
    compressor = BaseCompressor.load_from_registry(scheme.format or config.format)
    tensors = load_file(checkpoint / "model.safetensors")
    modules = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight_scale")}
    out = {n: t for n, t in tensors.items() if n.rsplit(".", 1)[0] not in modules}
    for module in modules:
        local = {n.rsplit(".", 1)[1]: t for n, t in tensors.items() if n.startswith(module + ".")}
        out[f"{module}.weight"] = compressor.decompress(local, scheme)["weight"]
    return out


def decompressed_model(checkpoint: Path) -> Any:
    """transformers' Llama (float32) on the decompressed weights, tied as the checkpoint says."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(TINY_LLAMA)
    tied = json.loads((checkpoint / "config.json").read_text()).get("tie_word_embeddings", False)
    config.tie_word_embeddings = tied
    model = LlamaForCausalLM(config)
    state = {n: t.float() for n, t in decompressed_state_dict(checkpoint).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
        raise ValueError(f"reference: missing {missing}, unexpected {unexpected}")
    if tied:  # the lm_head is the embedding's matrix
        model.tie_weights()
    return model.float().eval()
