"""What the pre-quantised checkpoint tests share (tests/runtime/test_rt_prequant.py for
compressed-tensors, test_rt_gptq_awq.py for GPTQ and AWQ): the prompts, the logit tolerance
against transformers, transformers' perplexity over token windows, and GPTQModel's checkpoints
from the reference cache."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the torch convention

from bench.reference.gptq_awq import GptqToolUnavailableError, reference_checkpoint

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


def gptqmodel_checkpoint(variant: str) -> Path:
    """The GPTQ/AWQ checkpoint GPTQModel wrote for `variant` of tiny-llama, from the reference
    cache (written by GPTQModel's tool venv the first time); skips only when that venv cannot
    be made (offline on a cold cache)."""
    try:
        return reference_checkpoint(variant)
    except GptqToolUnavailableError as error:
        pytest.skip(f"GPTQModel writes the GPTQ/AWQ checkpoints: {error}")
