"""Multi-LoRA on a mixed batch: every resident adapter's A and B stacked per projection, one
step's token rows grouped by their adapter's slot (layers/lora_groups.py); the base model's rows
skip LoRA entirely.

The base projection runs as ever (dense, int8 or int4: layers/quant.py), and the adapters add
their delta to its output, so how the base is stored does not matter. A projection's stacks are
A [S, in, k*R] and B [S, P, R, w] for S slots of rank up to R: each fused projection — qkv,
gate_up — holds k sub-modules, each with its own A and B. The k A's share the input, so they
sit side by side and one shrink serves them all (vLLM's packed qkv / gate_up LoRA). B is kept
compact, without the zeros of a block-diagonal [k*R, out]: the output's columns are cut in P
pieces of width w = gcd of the sub-modules' widths (`output_pieces`; qkv's q, k, v of 256, 64,
64 give w = 64, P = 6), each piece holding its sub-module's [R, w] slice of B^T, so the expand
is one batched matmul over (slot, piece), the rank-R columns of u of each piece's sub-module
against it (`expand`). That multiplies R x out per row, not k*R x out: on tiny-llama a third of
qkv's expand and half of gate_up's, the latter the widest LoRA matmul of a step. For the M rows
that run an adapter, grouped into G slots, the delta is S-LoRA's / Punica's segmented LoRA, no
per-sequence loop:

    runs (prefill chunks: MIN_RUN_ROWS rows or more of one slot, contiguous; the runner lays
    one adapter's chunks side by side):
        u = x[first:end] @ A[s]
        out[first:end, cols_j] += u[:, j] @ B[s, j]   # addmm per sub-module j: no gather, no
                                                        # index_add, no delta tensor
    the other rows, grouped by slot, either
    padded (decode-like steps, a few rows per slot; lora_groups.is_padding_cheap):
        u = x[grid] @ A[slots]          # [G, L, in] @ [G, in, k*R]  one batched matmul
        delta = expand(u, B[slots])     # [G*P, L, R] @ [G*P, R, w]  one batched matmul
    segmented (one group far longer than the others):
        delta[group g, cols_j] = (x[rows_g] @ A[s_g])[:, j] @ B[s_g, j]   for each of the G slots
    out.index_add_(0, rows, delta)   # [M, out] back to the rows' places

On CPU the padded form's rows run through one compiled op per projection where the kernel
library is built, torch.ops.kvpilot.lora_add_ (lora_add.cpp: each row's u = x[row] @ A[s] and
its pieces through B[s], summed in float and added into out[row] once); the tensor ops above are
about twenty aten ops per projection, whose dispatch was what LoRA added to a small model's
decode step.

Each row multiplies only its own slot's k*R columns (padding ranks below R and sub-modules an
adapter does not target are zeros, so they add nothing), where the masked form this replaced
ran every row through all S slots and zeroed the rest: S times the work.

Under tensor parallelism each rank's stacks hold its shard of every adapter, split as the base
weight is (engine/parallel.py, `lora_shard_dim`): column-parallel q/k/v and gate/up keep A whole
and B's slice of the output features; row-parallel o and down keep A's slice of the input
features and B whole, so each rank's delta is a partial sum that the base's all-reduce adds up.
"""

from __future__ import annotations

import math

import torch

from kvpilot.runtime.engine.parallel import TPGroup
from kvpilot.runtime.layers import paged_kernel
from kvpilot.runtime.layers.lora_groups import (
    SlotGroups,
    SlotRun,
    group_rows,
    is_padding_cheap,
    padded_rows,
    select_rows,
    slot_runs,
    without_runs,
)
from kvpilot.runtime.models.loader import ModelConfig
from kvpilot.runtime.models.lora_files import LoraAdapter, module_shape

# Private switch for bench.engine_lora's A/B only: False runs a decode-like step's groups padded
# through tensor ops where the compiled op (lora_add.cpp) would run them.
_COMPILED_ROWS = True

# The engine's fused projections and the checkpoint modules each holds, in output order.
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def output_pieces(outs: list[int]) -> tuple[int, list[int]]:
    """outs: the sub-modules' output widths, in output order -> (w, [P] each piece's
    sub-module): the output cut in pieces of one width w, the widest that divides every one."""
    width = math.gcd(*outs)
    return width, [j for j, out in enumerate(outs) for _ in range(out // width)]


def expand(u: torch.Tensor, b: torch.Tensor, piece_modules: torch.Tensor) -> torch.Tensor:
    """u [G, L, k*R] (each sub-module's R columns in turn), b [G, P, R, w] -> [G*L, P*w]: each
    row's u through its group's B, piece by piece (the module docstring)."""
    num_groups, num_rows, _ = u.shape
    _, num_pieces, rank, width = b.shape
    if num_pieces == 1:  # o, down: one sub-module, B whole
        return torch.bmm(u, b[:, 0]).flatten(0, 1)
    # [G, k, L, R] as a view, so the gather of each piece's sub-module is the only copy
    u = u.view(num_groups, num_rows, -1, rank).transpose(1, 2).index_select(1, piece_modules)
    u = u.reshape(num_groups * num_pieces, num_rows, rank)  # [G*P, L, R], a view
    delta = torch.bmm(u, b.view(num_groups * num_pieces, rank, width))  # [G*P, L, w]
    delta = delta.view(num_groups, num_pieces, num_rows, width).transpose(1, 2)
    return delta.reshape(num_groups * num_rows, num_pieces * width)


class LoraStack:
    """One fused projection's A and B over all slots: A [S, in, k*R], B [S, P, R, w]."""

    def __init__(
        self,
        cfg: ModelConfig,
        modules: tuple[str, ...],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        group: TPGroup | None = None,
    ) -> None:
        """`cfg`: this rank's share of the model (parallel.shard_config) under `group`."""
        shapes = [module_shape(cfg, m) for m in modules]
        self.modules, self.max_rank, self.group = modules, max_rank, group or TPGroup()
        self.outs = [out for out, _ in shapes]
        self.columns = [sum(self.outs[:j]) for j in range(len(modules))]  # each one's first
        self.width = len(modules) * max_rank  # columns of A per slot
        in_features = shapes[0][1]
        self.piece_width, pieces = output_pieces(self.outs)
        self.piece_modules = torch.tensor(pieces, dtype=torch.long, device=device)  # [P]
        self.first_piece = [pieces.index(j) for j in range(len(modules))]
        self.a = torch.zeros(num_slots, in_features, self.width, dtype=dtype, device=device)
        self.b = torch.zeros(
            num_slots, len(pieces), max_rank, self.piece_width, dtype=dtype, device=device
        )
        # Per slot: whether its adapter targets any of these modules. PEFT's default targets
        # (q_proj, v_proj) leave o, gate_up and down all zeros: a step skips them.
        self.is_targeted = [False] * num_slots

    def set_slot(self, slot: int, adapter: LoraAdapter, layer: int) -> None:
        """Write the adapter's A and B (zeros for what it does not target) into `slot`."""
        self.a[slot] = 0
        self.b[slot] = 0
        self.is_targeted[slot] = any((layer, m) in adapter.weights for m in self.modules)
        for j, module in enumerate(self.modules):
            pair = adapter.weights.get((layer, module))
            if pair is None:
                continue
            a, b = self.group.shard_lora(module, *pair)  # [r, in], [out, r] of this rank
            rank, column = a.shape[0], j * self.max_rank
            self.a[slot, :, column : column + rank] = a.t()
            pieces = b.t().reshape(rank, -1, self.piece_width).transpose(0, 1)  # [n, r, w]
            first = self.first_piece[j]
            self.b[slot, first : first + pieces.shape[0], :rank] = pieces

    def add_delta(self, out: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """out [T, out] += each adapter row's delta for x [T, in], in place."""
        for run in batch.runs:
            if self.is_targeted[run.slot]:
                u = x[run.first : run.end] @ self.a[run.slot]  # [n, k*R]
                self.add_expanded(out[run.first : run.end], u, run.slot, beta=1)
        if batch.num_rows == 0 or not any(self.is_targeted[slot] for slot in batch.slots):
            return out
        if batch.compiled:
            args = (batch.rows, batch.starts, batch.slot_ids, self.a, self.b, self.piece_modules)
            torch.ops.kvpilot.lora_add_(out, x, *args)
            return out
        if batch.grid is not None:
            # index_select, not x[grid]: advanced indexing costs twice as much on these sizes
            x_grid = x.index_select(0, batch.grid).view(batch.num_slots, -1, x.shape[1])
            u = torch.bmm(x_grid, batch.weights(self.a))  # [G, L, k*R]
            delta = self.expand(u, batch.weights(self.b))  # [G*L, out]
            if batch.positions is not None:  # drop the padding rows
                delta = delta.index_select(0, batch.positions)
        else:
            x_rows = x[batch.rows]  # [M, in], grouped by slot
            delta = x_rows.new_empty(x_rows.shape[0], out.shape[1])  # [M, out]
            for slot, first, end in batch.segments:
                u = x_rows[first:end] @ self.a[slot]  # [n, k*R]
                self.add_expanded(delta[first:end], u, slot, beta=0)
        return out.index_add_(0, batch.rows, delta)

    def expand(self, u: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """u [G, L, k*R] through b [G, P, R, w] -> [G*L, out]."""
        return expand(u, b, self.piece_modules)

    def add_expanded(self, dest: torch.Tensor, u: torch.Tensor, slot: int, beta: int) -> None:
        """dest [n, out] = beta * dest + u [n, k*R] through `slot`'s B, in place: one addmm
        per sub-module into its columns of dest. BLAS adds the product as it writes it, where
        `expand` (one batched matmul over the pieces) writes the product, copies it back from
        piece order and adds it: on a prefill chunk, rows x out values each pass, ~8x the time
        of the addmm's (512 rows of the compute-bound bench model's gate_up, bf16, one thread:
        15 ms against 2 ms, the base projection's own matmul 13 ms). beta 0: dest's values,
        even NaN, are ignored (a fresh tensor)."""
        rank = self.max_rank
        for j, (column, width) in enumerate(zip(self.columns, self.outs, strict=True)):
            dest[:, column : column + width].addmm_(
                u[:, j * rank : (j + 1) * rank], self.module_b(slot, j), beta=beta
            )

    def module_b(self, slot: int, module: int) -> torch.Tensor:
        """[R, out_j] sub-module j's B^T in `slot`: a view where it is one piece (o, down,
        gate and up here), else a copy of R x out_j values."""
        first = self.first_piece[module]
        num_pieces = self.outs[module] // self.piece_width
        pieces = self.b[slot, first : first + num_pieces]  # [n, R, w]
        if num_pieces == 1:
            return pieces[0]
        return pieces.transpose(0, 1).reshape(self.max_rank, self.outs[module])


def compiled_rows(device: torch.device) -> bool:
    """Whether a decode-like step's rows run through the compiled op: on CPU, where the kernel
    library is built (it is never built for this)."""
    return _COMPILED_ROWS and device.type == "cpu" and paged_kernel.loaded_without_building()


class LoraBatch:
    """One step's rows grouped by slot, as tensors on the device, made once per step and read
    by every layer; `output`: the same for the rows the last layer keeps (None: no adapter)."""

    def __init__(
        self, groups: SlotGroups, device: torch.device, runs: list[SlotRun] | None = None
    ) -> None:
        """groups: the rows grouped by slot; runs: the rows set apart as slices (slot_runs)."""
        self.runs = runs or []
        self.num_rows = groups.num_rows
        self.rows = torch.tensor(groups.rows, dtype=torch.long, device=device)  # [M]
        self.slots = groups.slots  # [G]
        self.segments = [
            (slot, groups.starts[g], groups.starts[g + 1]) for g, slot in enumerate(groups.slots)
        ]
        # Slots 0..G-1 (the usual case: the lowest free slot is filled first) are a view.
        is_prefix = groups.slots == list(range(len(groups.slots)))
        self.slot_index = (
            None if is_prefix else torch.tensor(groups.slots, dtype=torch.long, device=device)
        )
        self.num_slots = len(groups.slots)
        self.grid: torch.Tensor | None = None  # [G*L] when the padded form runs, flat
        self.positions: torch.Tensor | None = None  # [M] real rows in the grid; None: all are
        # Decode-like groups on CPU run through torch.ops.kvpilot.lora_add_ where it is built:
        # one op per projection, where the padded form is about twenty (lora_add.cpp).
        is_decode_like = bool(groups.rows) and is_padding_cheap(groups)
        self.compiled = is_decode_like and compiled_rows(device)
        if self.compiled:
            self.starts = torch.tensor(groups.starts, dtype=torch.long)  # [G + 1]
            self.slot_ids = torch.tensor(groups.slots, dtype=torch.long)  # [G]
        elif is_decode_like:
            grid, positions = padded_rows(groups)
            self.grid = torch.tensor(grid, dtype=torch.long, device=device).flatten()
            if len(positions) < self.grid.numel():
                self.positions = torch.tensor(positions, dtype=torch.long, device=device)
        self.output: LoraBatch | None = None

    @classmethod
    def of_rows(
        cls, row_slots: list[int], output_rows: list[int], device: torch.device
    ) -> LoraBatch | None:
        """row_slots [T]: each row's slot, -1 for the base model; output_rows: the rows the
        last layer keeps. None when no row runs an adapter."""
        runs = slot_runs(row_slots)
        groups = group_rows(without_runs(row_slots, runs))
        if not groups.rows and not runs:
            return None
        batch = cls(groups, device, runs)
        kept = group_rows(select_rows(row_slots, output_rows))
        batch.output = cls(kept, device) if kept.rows else None
        return batch

    def weights(self, stacked: torch.Tensor) -> torch.Tensor:
        """[G, ...] the groups' slots of a stack [S, ...]."""
        if self.slot_index is None:
            return stacked[: self.num_slots]
        return stacked.index_select(0, self.slot_index)


class LayerLora:
    """A decoder layer's stacks, one per fused projection."""

    def __init__(self, stacks: dict[str, LoraStack], layer: int) -> None:
        self.stacks, self.layer = stacks, layer

    def add(self, group: str, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """out [T, out] (the base projection of x [T, in]) plus each row's adapter's delta."""
        return self.stacks[group].add_delta(out, x, batch)


class LoraWeights:
    """Every layer's stacks: `num_slots` adapters resident for batching (--max-loras)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        group: TPGroup | None = None,
    ) -> None:
        """`cfg`: this rank's share of the model under tensor-parallel `group` (None: one)."""
        self.num_slots, self.max_rank, self.dtype = num_slots, max_rank, dtype
        tp = group or TPGroup()
        self.layers = [
            LayerLora(
                {
                    name: LoraStack(cfg, modules, num_slots, max_rank, dtype, device, tp)
                    for name, modules in FUSED_GROUPS.items()
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
