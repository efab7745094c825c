"""Our model's logits equal transformers' on the same checkpoint (fp32, within 1e-4), through
every attention path: whole prefill, a prefill chunk over cached KV, and batched decodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.reference.models import hf_logits, our_logits

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

TOLERANCE = 1e-4


PROMPTS = [list(range(5, 45)), [1, 9, 33, 17], list(range(100, 133)), [1]]


@pytest.mark.parametrize(
    ("chunks", "decode_group_limits"),
    [
        ([], None),  # one prefill each
        ([7], None),  # a first chunk, then a chunk attending to cached KV
        ([20, 1, 1, 1, 1], None),  # chunk, then tokens one at a time through batched decodes
        # The same decodes one per attention group (more splits: test_rt_attention.py).
        ([20, 1, 1, 1, 1], (1, 1)),
    ],
    ids=["prefill", "chunked", "decode", "decode-groups"],
)
def test_tiny_llama_logits_match_transformers(
    tiny_llama_dir: Path,
    hf_tiny_llama: Any,
    chunks: list[int],
    decode_group_limits: tuple[int, int] | None,
) -> None:
    ours = our_logits(tiny_llama_dir, PROMPTS, chunks, decode_group_limits)
    for prompt, logits in zip(PROMPTS, ours, strict=True):
        torch.testing.assert_close(logits, hf_logits(hf_tiny_llama, prompt), atol=TOLERANCE, rtol=0)


def random_checkpoint(kind: str, path: Path) -> Any:
    """A random tiny model of an architecture family, saved in HF format, and its HF module."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if kind == "qwen2":
        config: Any = transformers.Qwen2Config(**common, tie_word_embeddings=False)
        model: Any = transformers.Qwen2ForCausalLM(config)
    elif kind == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=4096)
        model = transformers.MistralForCausalLM(config)
    else:  # Llama 3.1 style RoPE scaling, tied embeddings
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
        config = transformers.LlamaConfig(
            **common, rope_parameters=scaling, tie_word_embeddings=True
        )
        model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # default init is zero, which would not test the bias
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "llama3"])
def test_random_checkpoint_logits_match_transformers(tmp_path: Path, kind: str) -> None:
    hf_model = random_checkpoint(kind, tmp_path)
    if kind == "qwen2":
        assert hf_model.model.layers[0].self_attn.q_proj.bias is not None
    prompts = [list(range(3, 90)), [7, 8, 9]]
    for chunks in ([], [11, 1, 1]):
        ours = our_logits(tmp_path, prompts, chunks)
        for prompt, logits in zip(prompts, ours, strict=True):
            torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=TOLERANCE, rtol=0)
