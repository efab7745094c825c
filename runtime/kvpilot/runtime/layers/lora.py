"""Multi-LoRA on a mixed batch: every resident adapter's A and B stacked per projection, one
step's tokens each picking its adapter's slot (or none: the base model).

The base projection runs as ever (dense, int8 or int4: layers/quant.py), and the adapters add
their delta to its output, so how the base is stored does not matter. For a projection with
S slots of rank up to R (each fused projection — qkv, gate_up — holds k sub-modules, each with
its own A and B), the delta of a whole batch is three dense ops, no per-sequence loop:

    u = x @ A_all                # [T, in] @ [in, S*k*R]   every token through every slot's A
    u = u * slot_mask            # [T, S*k*R]              keep only the token's own slot
    delta = u @ B_all            # [S*k*R, out]            B block-diagonal over k sub-modules

Padding ranks below R and sub-modules an adapter does not target are zeros, so they add nothing.
This is S-LoRA's / Punica's batched LoRA in its masked form: the waste is S*k*R columns instead
of one slot's k*R per token, small beside the base matmul while S*k*R << in (tiny-llama's
qkv: 8 slots x 3 x 16 = 384 against 256 in; a 7B model's 4096), and in return every step is two
ordinary matmuls that the CPU's and GPU's BLAS run at full speed. Only slots up to the highest
one the step uses are multiplied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpilot.runtime.models.loader import ModelConfig
from kvpilot.runtime.models.lora_files import LoraAdapter, module_shape

# The engine's fused projections and the checkpoint modules each holds, in output order.
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoraStack:
    """One fused projection's A and B over all slots: A [in, S*k*R], B [S*k*R, out_total]."""

    def __init__(
        self,
        cfg: ModelConfig,
        modules: tuple[str, ...],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shapes = [module_shape(cfg, m) for m in modules]
        self.modules, self.max_rank = modules, max_rank
        self.outs = [out for out, _ in shapes]
        self.offsets = [sum(self.outs[:j]) for j in range(len(modules))]
        self.width = len(modules) * max_rank  # columns per slot
        in_features = shapes[0][1]
        self.a = torch.zeros(in_features, num_slots * self.width, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots * self.width, sum(self.outs), dtype=dtype, device=device)

    def set_slot(self, slot: int, adapter: LoraAdapter, layer: int) -> None:
        """Write the adapter's A and B (zeros for what it does not target) into `slot`."""
        first = slot * self.width
        self.a[:, first : first + self.width] = 0
        self.b[first : first + self.width] = 0
        for j, module in enumerate(self.modules):
            pair = adapter.weights.get((layer, module))
            if pair is None:
                continue
            a, b = pair  # [r, in], [out, r]
            rank, column = a.shape[0], first + j * self.max_rank
            self.a[:, column : column + rank] = a.t()
            out = slice(self.offsets[j], self.offsets[j] + self.outs[j])
            self.b[column : column + rank, out] = b.t()

    def add_delta(self, out: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """out [T, out] += the adapters' delta for x [T, in]; mask [T, n*k*R] covers the first
        n slots. In place: one matmul, one multiply, one fused multiply-add."""
        columns = mask.shape[1]
        shrunk = (x @ self.a[:, :columns]).mul_(mask)  # [T, n*k*R]
        return out.addmm_(shrunk, self.b[:columns])


@dataclass
class LoraBatch:
    """One step's adapter choice per token row: a one-hot [T, n] over the first n slots (n: the
    highest slot used + 1), widened per sub-module count once and reused by every layer."""

    one_hot: torch.Tensor  # [T, n]
    max_rank: int
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of_rows(
        cls, row_slots: list[int], max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> LoraBatch | None:
        """row_slots [T]: each row's slot, -1 for the base model; None when no row has one."""
        num_used = max(row_slots, default=-1) + 1
        if num_used == 0:
            return None
        slots = torch.tensor(row_slots, device=device)
        one_hot = (slots[:, None] == torch.arange(num_used, device=device)).to(dtype)
        return cls(one_hot, max_rank)

    def mask(self, num_modules: int) -> torch.Tensor:
        """[T, n*k*R]: each slot's flag repeated over its k*R columns."""
        if num_modules not in self._masks:
            width = num_modules * self.max_rank
            self._masks[num_modules] = self.one_hot.repeat_interleave(width, dim=1)
        return self._masks[num_modules]

    def rows(self, rows: torch.Tensor) -> LoraBatch:
        """The batch of the rows kept (a layer's output rows)."""
        return LoraBatch(self.one_hot[rows], self.max_rank)


class LayerLora:
    """A decoder layer's stacks, one per fused projection."""

    def __init__(self, stacks: dict[str, LoraStack], layer: int) -> None:
        self.stacks, self.layer = stacks, layer

    def add(self, group: str, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """out [T, out] (the base projection of x [T, in]) plus the token's adapter's delta."""
        stack = self.stacks[group]
        return stack.add_delta(out, x, batch.mask(len(stack.modules)))


class LoraWeights:
    """Every layer's stacks: `num_slots` adapters resident for batching (--max-loras)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots, self.max_rank, self.dtype = num_slots, max_rank, dtype
        self.layers = [
            LayerLora(
                {
                    group: LoraStack(cfg, modules, num_slots, max_rank, dtype, device)
                    for group, modules in FUSED_GROUPS.items()
                },
                layer,
            )
            for layer in range(cfg.num_layers)
        ]

    def set_slot(self, slot: int, adapter: LoraAdapter) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in [0, {self.num_slots}), got {slot}")
        for layer in self.layers:
            for stack in layer.stacks.values():
                stack.set_slot(slot, adapter, layer.layer)

    def num_bytes(self) -> int:
        return sum(s.a.nbytes + s.b.nbytes for layer in self.layers for s in layer.stacks.values())
