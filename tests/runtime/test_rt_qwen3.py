"""Qwen3 dense against transformers' Qwen3ForCausalLM on a random small checkpoint saved with
`save_pretrained`: logits through prefill, chunked prefill and decodes (float32, bfloat16, and
int8 weights against the same weights rounded through our int8 format, to bfloat16's bound as
the int8 kernel takes bfloat16 activations), greedy tokens through
the engine, the parameter count, and tensor parallelism's per-rank q/k norms."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.reference.models import (
    QWEN3_PROMPTS,
    hf_greedy,
    hf_logits,
    our_logits,
    qwen3_checkpoint,
)
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.model_runner import load_model
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.layers.quant import make_weight
from kvpilot.runtime.models.loader import load_model_config

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

CHUNKINGS = [[], [11, 1, 1]]  # whole prefills; a chunk, cached-KV chunks, then decodes
MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("qwen3")
    return path, qwen3_checkpoint(path, tied=False)


def test_config_reads_qwen3(qwen3: tuple[Path, Any]) -> None:
    path, hf_model = qwen3
    cfg = load_model_config(path)
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert cfg.has_qk_norm and not cfg.has_qkv_bias
    assert cfg.head_dim == 48 and cfg.sliding_window is None and cfg.rope_theta == 1e6
    assert cfg.num_parameters == sum(p.numel() for p in hf_model.parameters())
    assert hf_model.model.layers[0].self_attn.q_proj.bias is None


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_float32(tmp_path: Path, tied: bool) -> None:
    hf_model = qwen3_checkpoint(tmp_path, tied)
    assert load_model_config(tmp_path).num_parameters == sum(
        p.numel() for p in hf_model.parameters()
    )
    for chunks in CHUNKINGS:
        ours = our_logits(tmp_path, QWEN3_PROMPTS, chunks)
        for prompt, logits in zip(QWEN3_PROMPTS, ours, strict=True):
            torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=1e-4, rtol=0)


def greedy(model_dir: Path, prompts: list[list[int]], **config: Any) -> list[list[int]]:
    engine = Engine(
        EngineConfig(model=str(model_dir), device="cpu", kv_cache_memory=16 * 2**20, **config)
    )
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)
    tokens: list[list[int]] = [[] for _ in prompts]
    try:
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, params, str(index))
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[int(out.request_id)] += out.new_token_ids
    finally:
        engine.shutdown()  # reaps tensor-parallel workers
    return tokens


def test_greedy_tokens_equal_transformers(qwen3: tuple[Path, Any]) -> None:
    path, hf_model = qwen3
    ours = greedy(path, QWEN3_PROMPTS, dtype="float32")
    assert ours == [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in QWEN3_PROMPTS]
    assert all(len(set(t)) > 1 for t in ours)  # not one token repeated: the model is exercised


def test_bfloat16_logits_close_to_transformers(tmp_path: Path) -> None:
    """Both sides in bfloat16 from a bfloat16 checkpoint: rounding differs by op order, so the
    bound is bfloat16's, and the top token must agree wherever transformers' is clear."""
    hf_model = qwen3_checkpoint(tmp_path, tied=True, dtype=torch.bfloat16)
    assert load_model_config(tmp_path).torch_dtype == "bfloat16"
    cfg = load_model_config(tmp_path)
    model = load_model(tmp_path, cfg, "none", torch.bfloat16, torch.device("cpu"))
    assert model.layers[0].qk_norm is not None and model.layers[0].qk_norm.dtype == torch.bfloat16
    ours = our_logits(tmp_path, QWEN3_PROMPTS, [], dtype=torch.bfloat16)
    for prompt, logits in zip(QWEN3_PROMPTS, ours, strict=True):
        reference = hf_logits(hf_model, prompt)
        scale = reference.abs().amax().item()
        torch.testing.assert_close(logits, reference, atol=0.05 * scale, rtol=0)
        top2 = reference.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1 * scale
        assert torch.equal(logits.argmax(-1)[clear], reference.argmax(-1)[clear])


def round_through_int8(hf_model: Any) -> Any:
    """transformers' model with every matrix our loader quantises replaced by what our int8
    format restores (per-output-channel scales, so fusing q/k/v or gate/up changes nothing)."""
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.dim() == 2:
                restored = make_weight(param.detach(), "int8", torch.float32)
                param.copy_(restored.dequantize(torch.float32))
    return hf_model


def test_int8_logits_match_transformers_on_the_same_weights(
    qwen3: tuple[Path, Any],
) -> None:
    """The int8 kernel takes its activations in bfloat16 (layers/quant.py), so under float32
    compute the bound is bfloat16's, as in the bf16 test above, and the top token must agree
    wherever the reference's is clear."""
    path, hf_model = qwen3
    import copy

    reference = round_through_int8(copy.deepcopy(hf_model))
    ours = our_logits(path, QWEN3_PROMPTS, [11, 1, 1], quantization="int8")
    for prompt, logits in zip(QWEN3_PROMPTS, ours, strict=True):
        expected = hf_logits(reference, prompt)
        scale = expected.abs().amax().item()
        torch.testing.assert_close(logits, expected, atol=0.02 * scale, rtol=0)
        top2 = expected.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1 * scale
        assert torch.equal(logits.argmax(-1)[clear], expected.argmax(-1)[clear])
    # Greedy tokens are not compared: on this random model near-ties are common, and one
    # bfloat16-rounded activation flips a near-tie and every token after it.


def test_tensor_parallel_greedy_tokens_equal_transformers(qwen3: tuple[Path, Any]) -> None:
    """Two gloo ranks, each with half the q heads and one KV head and its norm rows."""
    path, hf_model = qwen3
    ours = greedy(path, QWEN3_PROMPTS, dtype="float32", tensor_parallel_size=2)
    assert ours == [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in QWEN3_PROMPTS]


def test_tensor_parallel_ranks_hold_their_heads_norms(qwen3: tuple[Path, Any]) -> None:
    """Each rank normalises its own share of heads with the same (replicated) q/k norm rows."""
    from kvpilot.runtime.engine.parallel import TPGroup

    path, hf_model = qwen3
    cfg = load_model_config(path)
    attn = hf_model.model.layers[1].self_attn
    for rank in range(2):
        model = load_model(path, cfg, "none", torch.float32, torch.device("cpu"), TPGroup(rank, 2))
        norm = model.layers[1].qk_norm
        assert norm is not None and norm.shape == (2 + 1, 48)  # 4/2 q heads + 2/2 KV heads
        torch.testing.assert_close(norm[:2], attn.q_norm.weight.detach().expand(2, -1))
        torch.testing.assert_close(norm[2:], attn.k_norm.weight.detach().expand(1, -1))


# Qwen3 dense config.json figures: hidden, layers, heads, KV heads, intermediate, tied embeddings
QWEN3_CONFIGS = {
    "qwen/qwen3-0.6b": (1024, 28, 16, 8, 3072, True),
    "qwen/qwen3-1.7b": (2048, 28, 16, 8, 6144, True),
    "qwen/qwen3-4b": (2560, 36, 32, 8, 9728, True),
    "qwen/qwen3-8b": (4096, 36, 32, 8, 12288, False),
    "qwen/qwen3-14b": (5120, 40, 40, 8, 17408, False),
    "qwen/qwen3-32b": (5120, 64, 64, 8, 25600, False),
}


@pytest.mark.parametrize("key", sorted(QWEN3_CONFIGS))
def test_catalog_entries_equal_transformers_parameter_count(tmp_path: Path, key: str) -> None:
    """The operator's catalog against transformers' own model of each config (on the meta
    device: no memory), and our loader's count of the same config."""
    import transformers

    from kvpilot.contract import catalog

    hidden, layers, heads, kv_heads, intermediate, tied = QWEN3_CONFIGS[key]
    config = transformers.Qwen3Config(
        vocab_size=151_936,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=128,
        intermediate_size=intermediate,
        tie_word_embeddings=tied,
        architectures=["Qwen3ForCausalLM"],
    )
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        hf_model = transformers.Qwen3ForCausalLM(config)
    facts = catalog.CATALOG[key]
    assert facts.parameters == sum(p.numel() for p in hf_model.parameters())
    assert load_model_config(tmp_path).num_parameters == facts.parameters
    assert (facts.layers, facts.kv_heads, facts.head_dim) == (layers, kv_heads, 128)
