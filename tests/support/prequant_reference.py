"""What the pre-quantised checkpoint tests share (tests/runtime/test_rt_prequant.py for
compressed-tensors, test_rt_gptq_awq.py for GPTQ and AWQ): the prompts, the logit tolerance
against transformers, greedy tokens against transformers' (near-ties aside), transformers'
perplexity over token windows, and GPTQModel's checkpoints from the reference cache."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the torch convention

from bench.reference.gptq_awq import GptqToolUnavailableError, reference_checkpoint
from bench.reference.models import hf_greedy

PROMPTS = [list(range(5, 45)), [1, 9, 33, 17], list(range(100, 133))]
# fp32 compute: the int kernels round activations to bf16, and the reference's decompressed
# weights are bf16 products (ours are float32); a misread layout or scale moves logits by ~8.
LOGIT_TOLERANCE = 0.06


def hf_perplexity(hf: Any, windows: list[list[int]]) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            logits = hf(torch.tensor([ids])).logits[0, :-1].float()
            nll += float(F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
            count += len(ids) - 1
    return math.exp(nll / count)


def assert_greedy_matches(hf: Any, prompt: list[int], ours: list[int]) -> None:
    """Our greedy tokens are transformers' after `prompt`, step by step, except where its two
    best logits lie within LOGIT_TOLERANCE of each other: a tie the int kernels' bf16 rounding
    may break either way (an int4 lm_head rounds the last hidden state too). There ours must be
    one of those two, and past a tie broken the other way the texts go apart, so the
    comparison ends there. A misread layout or scale moves logits by far more than that."""
    reference = hf_greedy(hf, prompt, len(ours))
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + reference])).logits[0, len(prompt) - 1 : -1].float()
    best = logits.topk(2, dim=-1)
    for step, (token, expected) in enumerate(zip(ours, reference, strict=True)):
        values, indices = best.values[step], best.indices[step].tolist()
        if float(values[0] - values[1]) >= LOGIT_TOLERANCE or token == expected:
            assert token == expected, (step, ours, reference)
            continue
        assert token in indices, (step, ours, reference, indices)
        return


def gptqmodel_checkpoint(variant: str) -> Path:
    """The GPTQ/AWQ checkpoint GPTQModel wrote for `variant` of tiny-llama, from the reference
    cache (written by GPTQModel's tool venv the first time); skips only when that venv cannot
    be made (offline on a cold cache)."""
    try:
        return reference_checkpoint(variant)
    except GptqToolUnavailableError as error:
        pytest.skip(f"GPTQModel writes the GPTQ/AWQ checkpoints: {error}")


LAYER_MODULES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


def assert_shards_read_as_slices(path: Path, tensor_parallel_size: int = 2) -> list[str]:
    """Every quantised module of layer 0 read from each rank's share of the checkpoint's
    tensors (engine/parallel.py) dequantises to that rank's slice of the whole matrix: its
    outputs' slice for q/k/v and gate/up, its inputs' for o_proj and down_proj. Modules whose
    inputs a share would cut within a group are skipped, as check_prequantized_parallel
    refuses them (checked too). Returns the modules compared."""
    from kvpilot.contract.checkpoint_quant import check_prequantized_parallel
    from kvpilot.runtime.engine.parallel import TPGroup, row_parallel_inputs, shard_dim
    from kvpilot.runtime.layers.prequant import dequantize, read_matrix
    from kvpilot.runtime.models.loader import load_model_config, open_weights

    cfg = load_model_config(path)
    quant, compared = cfg.checkpoint_quant, []
    inputs = row_parallel_inputs(cfg)
    with open_weights(path) as read:
        for module in LAYER_MODULES:
            name = f"model.layers.0.{module}"
            if name in inputs:
                try:
                    check_prequantized_parallel(quant, tensor_parallel_size, {name: inputs[name]})
                except ValueError as error:
                    assert name in str(error)
                    continue
            whole = dequantize(read_matrix(read, name, quant))
            dim = shard_dim(f"{name}.weight")
            assert dim is not None, name
            for rank in range(tensor_parallel_size):
                group = TPGroup(rank, tensor_parallel_size)

                def shard_of(tensor_name: str, group: TPGroup = group) -> torch.Tensor | None:
                    tensor = read(tensor_name)
                    return None if tensor is None else group.shard(tensor_name, tensor)

                part = dequantize(read_matrix(shard_of, name, quant))
                expected = whole.chunk(tensor_parallel_size, dim=dim)[rank]
                torch.testing.assert_close(part, expected, rtol=0, atol=0)
            compared.append(module)
    return compared
