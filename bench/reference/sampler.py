"""A slow, row-at-a-time sampler written straight from the definitions (vLLM's and OpenAI's).

The reference the batched sampler (layers/sampler.py) is tested against, and the "per-row loop"
side of bench/sampler_step.py. It shares nothing with the batched code but SamplingRow (its
input): Python loops over tokens for bias, min_tokens and penalties, a descending sort per
row for top-k and top-p (the code this sampler replaced), and the exponential race with the
row's own noise.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from kvpilot.runtime.layers.sampler import SamplingRow

NEG_INF = float("-inf")


def processed_logits(
    row_logits: torch.Tensor, row: SamplingRow, eos: Sequence[int]
) -> torch.Tensor:
    """[V] -> [V]: logit bias, then min_tokens masking, then the penalties."""
    params, logits = row.params, row_logits.clone()
    for token, bias in params.logit_bias:
        logits[token] += bias
    if row.num_output_tokens < params.min_tokens:
        for token in [*params.stop_token_ids, *([] if params.ignore_eos else eos)]:
            logits[token] = NEG_INF
    output = Counter(row.token_ids[row.num_prompt_tokens :])
    for token in set(row.token_ids) if params.has_penalties else ():  # others keep theirs
        value = float(logits[token])
        if params.repetition_penalty != 1.0:
            penalty = params.repetition_penalty
            value = value / penalty if value > 0 else value * penalty
        value -= params.frequency_penalty * output[token]
        value -= params.presence_penalty * (token in output)
        logits[token] = value
    return logits


def filtered_logits(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """[V] processed logits of a row with temperature > 0 -> temperature, min-p, top-k, top-p."""
    params = row.params
    logits = logits / params.temperature
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), NEG_INF)
    ordered, order = torch.sort(logits, descending=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    if params.effective_top_k:
        kth = ordered[min(params.effective_top_k, len(ordered)) - 1]
        keep &= ordered >= kth
    probs = ordered.masked_fill(~keep, NEG_INF).softmax(-1)
    if params.top_p < 1.0:
        keep &= (probs.cumsum(-1) - probs) < params.top_p  # the likelier tokens' mass
        keep[0] = True
    return torch.full_like(logits, NEG_INF).scatter(0, order, ordered.masked_fill(~keep, NEG_INF))


def sample_row(
    row_logits: torch.Tensor, row: SamplingRow, eos: Sequence[int], noise: torch.Tensor | None
) -> int:
    """The next token of one row; `noise`: [V] Exp(1) draws, needed when temperature > 0."""
    logits = processed_logits(row_logits, row, eos)
    if row.params.is_greedy:
        return int(logits.argmax())
    assert noise is not None, "a row with temperature > 0 needs its noise"
    probs = filtered_logits(logits, row).softmax(-1)
    return int((probs / noise).argmax())


def sample_rows(
    logits: torch.Tensor, rows: list[SamplingRow], eos: Sequence[int] = ()
) -> list[int]:
    """Every row on its own; each drawn row's noise from its own generator (torch's global one
    for a row without)."""
    tokens = []
    for row_logits, row in zip(logits, rows, strict=True):
        noise = None
        if not row.params.is_greedy:
            # Exp(1) draws as -log(U), the batched sampler's way of drawing them.
            noise = -torch.rand(row_logits.shape, generator=row.generator).log()
        tokens.append(sample_row(row_logits, row, eos, noise))
    return tokens
