"""config.json files of real checkpoints (the fields the operator reads), for planner tables."""

from __future__ import annotations

from typing import Any

QWEN25_7B: dict[str, Any] = {  # Qwen/Qwen2.5-7B-Instruct's config.json, the fields read
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
}
# Qwen/Qwen2.5-7B-Instruct-AWQ: the same shapes, and this quantization_config
QWEN25_7B_AWQ = QWEN25_7B | {
    "quantization_config": {
        "bits": 4,
        "group_size": 128,
        "modules_to_not_convert": None,
        "quant_method": "awq",
        "version": "gemm",
        "zero_point": True,
    }
}
# A GPTQ 4-bit checkpoint of the same model (what AutoGPTQ / GPTQModel write)
QWEN25_7B_GPTQ = QWEN25_7B | {
    "quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
    }
}
# ... and as llm-compressor writes a W4A16 one: pack-quantized int4, group 128, lm_head left out
QWEN25_7B_CT_INT4 = QWEN25_7B | {
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "type": "int",
                    "num_bits": 4,
                    "strategy": "group",
                    "group_size": 128,
                    "symmetric": True,
                },
            }
        },
        "ignore": ["lm_head"],
    }
}
TINYLLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 32,
    "num_hidden_layers": 22,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}
QWEN3_8B: dict[str, Any] = {
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
QWEN3_0_6B = QWEN3_8B | {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "tie_word_embeddings": True,
}
# Per decoder layer of Qwen2.5-7B: q/k/v 3584 x (3584 + 2 x 512), o 3584^2, MLP 3 x 3584 x 18944
QWEN25_7B_LAYER = 3584 * 4608 + 3584 * 3584 + 3 * 3584 * 18944
QWEN25_7B_PARAMETERS = 7_615_616_512  # its model card's, which the shapes give too
