"""The grammar step of sampling: disallowed tokens' logits to -inf for the whole batch at once.

llguidance fills one bit per token for each constrained sequence (on its own threads, in
parallel); the bits are unpacked and applied on the logits' device in a few tensor ops, whatever
the number of constrained sequences. Unconstrained rows are left untouched.
"""

from __future__ import annotations

import torch
from llguidance import LLExecutor, LLMatcher
from llguidance.torch import fill_next_token_bitmask_par

BITS = 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, shifts: torch.Tensor) -> torch.Tensor:
    """bitmask [G, W] int32 (bit j of word w allows token 32 w + j) -> allowed [G, vocab] bool.
    `>>` is arithmetic on int32, so the sign bit (token 32 w + 31) comes out as 1 too."""
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [G, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


class GrammarMasker:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.num_words = -(-vocab_size // BITS)
        self.shifts = torch.arange(BITS, dtype=torch.int32, device=device)
        self.executor: LLExecutor | None = None  # its threads start with the first grammar
        self._bitmask = torch.empty(0, self.num_words, dtype=torch.int32)

    @torch.inference_mode()  # the logits are inference tensors, changed in place
    def apply(self, logits: torch.Tensor, matchers: list[LLMatcher | None]) -> None:
        """logits [S, vocab] float32, in place; matchers[i] constrains row i (None: free)."""
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_stopped()]
        if not rows:
            return
        bitmask = self._buffer(len(rows))
        if self.executor is None:
            self.executor = LLExecutor()
        pairs = [(matchers[row], k) for k, row in enumerate(rows)]
        fill_next_token_bitmask_par(self.executor, pairs, bitmask)  # type: ignore[arg-type]
        device_mask = bitmask.to(self.device, non_blocking=True)
        allowed = unpack_bitmask(device_mask, logits.shape[-1], self.shifts)  # [G, vocab]
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """A [num_rows, W] view of a reused host buffer (pinned on CUDA for the async copy)."""
        if self._bitmask.shape[0] < num_rows:
            pin = self.device.type == "cuda"
            self._bitmask = torch.empty(
                max(num_rows, 2 * self._bitmask.shape[0]), self.num_words, dtype=torch.int32,
                pin_memory=pin,
            )  # fmt: skip
        return self._bitmask[:num_rows]
