"""The grammar step of sampling: disallowed tokens' logits to -inf for the whole batch at once.

llguidance fills one bit per token for each constrained sequence; the bits are unpacked and
applied on the logits' device in a few tensor ops, whatever the number of constrained sequences.
Unconstrained rows are left untouched.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from llguidance import LLExecutor, LLMatcher

# The numpy helpers, not llguidance.torch's: that module compiles a function with torch.compile
# at import, which imports torch._dynamo (5.4 s of a 7.8 s `import kvpilot.runtime.engine.engine` on
# 2 cores, at every runtime start). The bitmask is a host tensor, so its numpy view is the
# same memory.
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

BITS = 32
# llguidance's executor takes 80% of the CPUs: below 4 that is one worker, and handing the
# fill to it only adds a thread switch (8 ms a step on a busy 2-core machine, against 0.3 ms
# filling on the engine's thread). The per-row fill drops the GIL too.
MIN_CPUS_FOR_PARALLEL_FILL = 4


def num_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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
        self.is_parallel = num_cpus() >= MIN_CPUS_FOR_PARALLEL_FILL
        self.executor: LLExecutor | None = None  # its threads start with the first grammar
        self._bitmask = torch.empty(0, self.num_words, dtype=torch.int32)

    @torch.inference_mode()  # the logits are inference tensors, changed in place
    def apply(self, logits: torch.Tensor, matchers: Sequence[LLMatcher | None]) -> None:
        """logits [S, vocab] float32, in place; matchers[i] constrains row i (None: free)."""
        active = [(i, m) for i, m in enumerate(matchers) if m is not None and not m.is_stopped()]
        if not active:
            return
        rows = [row for row, _ in active]
        bitmask = self._buffer(len(rows))
        self._fill(bitmask, [matcher for _, matcher in active])
        device_mask = bitmask.to(self.device, non_blocking=True)
        allowed = unpack_bitmask(device_mask, logits.shape[-1], self.shifts)  # [G, vocab]
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

    def _fill(self, bitmask: torch.Tensor, matchers: list[LLMatcher]) -> None:
        """Row k of `bitmask` := the tokens matchers[k] allows next."""
        if not self.is_parallel:
            for k, matcher in enumerate(matchers):
                fill_next_token_bitmask(matcher, bitmask.numpy(), k)
            return
        if self.executor is None:
            self.executor = LLExecutor()
        pairs = [(matcher, k) for k, matcher in enumerate(matchers)]
        fill_next_token_bitmask_par(self.executor, pairs, bitmask.numpy())

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """A [num_rows, W] view of a reused host buffer (pinned on CUDA for the async copy)."""
        if self._bitmask.shape[0] < num_rows:
            pin = self.device.type == "cuda"
            self._bitmask = torch.empty(
                max(num_rows, 2 * self._bitmask.shape[0]), self.num_words, dtype=torch.int32,
                pin_memory=pin,
            )  # fmt: skip
        return self._bitmask[:num_rows]
