"""One step's mixed batch for checking an attention backend against another: decodes, a decode
with proposals, fresh prompts and chunks over cached KV, on shuffled blocks of the pool; and
keys and values that an fp8 cache holds exactly."""

from __future__ import annotations

import torch

from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.scheduler import ScheduledSequence
from kvpilot.runtime.engine.sequence import Sequence

# (tokens computed before, tokens this step, of which proposals) per sequence
MIXED_STEP = [(40, 1, 0), (0, 12, 0), (16, 1, 0), (20, 4, 3), (33, 1, 0), (20, 7, 0), (15, 9, 0)]


def mixed_batch(num_blocks: int, contexts: list[tuple[int, int, int]]) -> list[ScheduledSequence]:
    """`contexts` as MIXED_STEP's, each sequence on blocks drawn at random from the pool
    (torch's global generator: seed it first)."""
    free = torch.randperm(num_blocks).tolist()
    batch = []
    for index, (computed, new, drafts) in enumerate(contexts):
        seq = Sequence(str(index), list(range(computed + new - drafts)))
        seq.num_computed_tokens, seq.draft_token_ids = computed, [5] * drafts
        blocks = -(-(computed + new) // BLOCK_SIZE)
        seq.block_table, free = free[:blocks], free[blocks:]
        batch.append(ScheduledSequence(seq, new, drafts))
    return batch


def fp8_exact(*shape: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Random multiples of 1/4 within +-4: exact in float8_e4m3fn divided by a scale of 1, 1/2
    or 1/4 (and in bf16), so a backend that reads a fresh chunk back from an fp8 cache and one
    that does not see the same numbers."""
    return (torch.randn(shape, device=device) * 4).round().clamp(-16, 16) / 4
