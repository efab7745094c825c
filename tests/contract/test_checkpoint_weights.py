"""A pre-quantised checkpoint's bytes as the runtime holds them, from its config.json alone.

Figures by hand: a linear module of `in x out` parameters at int4 with group g costs
in x out x (0.5 + 4 / g) bytes (two values a byte, a bf16 scale and zero per group), at int8 one
byte, fp8 two (dequantised at load); embeddings, norms and unquantised modules two.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.contract import catalog
from kvpilot.contract.checkpoint_weights import (
    architecture_parameters,
    linear_modules,
    read_checkpoint_weights,
)
from tests.support.checkpoint_configs import (
    QWEN3_0_6B,
    QWEN3_8B,
    QWEN25_7B,
    QWEN25_7B_AWQ,
    QWEN25_7B_LAYER,
    TINYLLAMA,
)

TINYLLAMA_LAYER = 2048 * (2048 + 2 * 256) + 2048 * 2048 + 3 * 2048 * 5632
TINYLLAMA_LM_HEAD = 2048 * 32000


def compressed_tensors(weights: dict[str, Any], fmt: str, ignore: list[str]) -> dict[str, Any]:
    """TinyLlama as llm-compressor saves it: one config group over every Linear."""
    group = {"targets": ["Linear"], "weights": weights}
    return TINYLLAMA | {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": fmt,
            "config_groups": {"group_0": group},
            "ignore": ignore,
            "quantization_status": "compressed",
        }
    }


INT4_GROUP_32 = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32}
INT8_CHANNEL = {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True}
FP8_CHANNEL = {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True}


@pytest.mark.parametrize(
    ("uri", "config"),
    [
        ("hf://Qwen/Qwen2.5-7B-Instruct", QWEN25_7B),  # q/k/v biases
        ("hf://TinyLlama/TinyLlama-1.1B-Chat-v1.0", TINYLLAMA),
        ("hf://Qwen/Qwen3-8B", QWEN3_8B),  # q/k norms, head_dim given
        ("hf://Qwen/Qwen3-0.6B", QWEN3_0_6B),  # tied embeddings: no lm_head
    ],
)
def test_the_shapes_count_what_the_model_cards_count(uri: str, config: dict[str, Any]) -> None:
    known = catalog.lookup(uri)
    assert known is not None
    assert architecture_parameters(config) == known.parameters


def test_a_tied_model_has_no_lm_head_and_an_untied_one_has() -> None:
    assert "lm_head" not in dict(linear_modules(QWEN3_0_6B))
    assert dict(linear_modules(TINYLLAMA))["lm_head"] == (2048, 32000)
    assert len(linear_modules(TINYLLAMA)) == 22 * 7 + 1


@pytest.mark.parametrize(
    ("config", "level", "quantized_parameters", "quantized_bytes"),
    [
        # AWQ packs every decoder projection, never the lm_head: 0.5 + 4/128 bytes each
        (QWEN25_7B_AWQ, "int4", 28 * QWEN25_7B_LAYER, 28 * QWEN25_7B_LAYER * (0.5 + 4 / 128)),
        # compressed-tensors honours its ignore list: lm_head stays 16-bit
        (
            compressed_tensors(INT4_GROUP_32, "pack-quantized", ["lm_head"]),
            "int4",
            22 * TINYLLAMA_LAYER,
            22 * TINYLLAMA_LAYER * (0.5 + 4 / 32),
        ),
        # ... and quantises the lm_head where the list does not name it
        (
            compressed_tensors(INT4_GROUP_32, "pack-quantized", []),
            "int4",
            22 * TINYLLAMA_LAYER + TINYLLAMA_LM_HEAD,
            (22 * TINYLLAMA_LAYER + TINYLLAMA_LM_HEAD) * (0.5 + 4 / 32),
        ),
        (
            compressed_tensors(INT8_CHANNEL, "naive-quantized", ["lm_head"]),
            "int8",
            22 * TINYLLAMA_LAYER,
            22 * TINYLLAMA_LAYER * 1.0,
        ),
        # fp8 is dequantised at load: it saves download, not memory; it runs as level none
        (
            compressed_tensors(FP8_CHANNEL, "float-quantized", ["lm_head"]),
            "none",
            22 * TINYLLAMA_LAYER,
            22 * TINYLLAMA_LAYER * 2.0,
        ),
    ],
)
def test_a_checkpoint_costs_its_quantised_modules_as_stored(
    config: dict[str, Any], level: str, quantized_parameters: int, quantized_bytes: float
) -> None:
    weights = read_checkpoint_weights(config)
    assert weights is not None
    assert weights.level == level
    assert weights.quantized_parameters == quantized_parameters
    assert weights.quantized_bytes == pytest.approx(quantized_bytes)


def test_awq_modules_to_not_convert_stay_16_bit() -> None:
    config = QWEN25_7B_AWQ | {
        "quantization_config": QWEN25_7B_AWQ["quantization_config"]
        | {"modules_to_not_convert": ["mlp"]}
    }
    weights = read_checkpoint_weights(config)
    assert weights is not None
    assert weights.quantized_parameters == 28 * (3584 * 4608 + 3584 * 3584)


def test_gptq_dynamic_skips_stay_16_bit() -> None:
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 64, "dynamic": {"-:.*down_proj": {}}}
    weights = read_checkpoint_weights(QWEN25_7B | {"quantization_config": gptq})
    assert weights is not None
    assert weights.quantized_parameters == 28 * (QWEN25_7B_LAYER - 18944 * 3584)
    assert weights.quantized_bytes == pytest.approx(weights.quantized_parameters * (0.5 + 4 / 64))


def test_a_16_bit_checkpoint_has_no_checkpoint_weights() -> None:
    assert read_checkpoint_weights(QWEN25_7B) is None


@pytest.mark.parametrize(
    ("quantization_config", "field"),
    [
        ({"quant_method": "awq", "bits": 3, "group_size": 128}, "quantization_config.bits: 3"),
        ({"quant_method": "bitsandbytes"}, 'quantization_config.quant_method: "bitsandbytes"'),
        ({"quant_method": "gptq", "bits": 4, "group_size": 256}, "quantization_config.group_size"),
    ],
)
def test_what_the_runtime_refuses_is_refused_naming_the_field(
    quantization_config: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match="is not supported") as error:
        read_checkpoint_weights(QWEN25_7B | {"quantization_config": quantization_config})
    assert field in str(error.value)
