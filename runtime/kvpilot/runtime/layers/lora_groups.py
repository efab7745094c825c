"""A step's token rows grouped by LoRA slot (pure Python): the plan the segmented LoRA matmul
(layers/lora.py) runs, made once per step from the rows' slots and shared by every layer.

Rows of the base model (slot -1) are in no group: they skip LoRA entirely. Each group is one
slot's rows, ascending; groups in slot order. Two ways to run the groups, as Punica's SGMV and
S-LoRA's kernels do on a GPU, but with stock BLAS:

- padded: every group padded to the longest, [G, L] row indices, two batched matmuls over the
  G slots' weights: a few ops whatever G, but the padding rows are wasted work;
- segmented: one pair of matmuls per group, over exactly its rows: no waste, 2G ops.

Which is cheaper is a matter of op overhead against rows multiplied: on CPU a group's own pair
of small matmuls costs about as much as 40 padded rows of tiny-llama's widest projection (45 us
against ~1.1 us a row, bf16), and a GPU's kernel launch still more. So `is_padding_cheap` keeps
the padded form (decode steps, many slots with a few rows each) while the padding is at most
MAX_PADDING_PER_GROUP rows per group, and a long group (a prefill chunk) runs segmented.

Before grouping, a run of at least MIN_RUN_ROWS consecutive rows of one slot is set apart
(`slot_runs`): a prefill chunk's rows are contiguous in the step's layout (decodes first, then
each chunk whole), so it multiplies a slice of x and adds to a slice of the output, with no gather
and no index_add; and it no longer makes the decodes' groups uneven, so they stay padded, one
pair of batched matmuls, where one chunk beside them used to turn every group segmented (in a
closed loop nearly every step admits a prompt).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

# Padding rows (G x L less the real ones) allowed per group before the segmented form is used.
MAX_PADDING_PER_GROUP = 32
# Consecutive rows of one slot that run as a slice of their own: a prefill chunk, while decode
# rows (sorted by context length, not by slot) rarely line up that long.
MIN_RUN_ROWS = 16


@dataclass(frozen=True)
class SlotRun:
    """Rows first..end-1, all of one slot."""

    slot: int
    first: int
    end: int


@dataclass(frozen=True)
class SlotGroups:
    slots: list[int]  # [G] the slots used, ascending
    rows: list[int]  # [M] the rows that run an adapter, grouped by slot
    starts: list[int]  # [G + 1] group g is rows[starts[g]:starts[g + 1]]

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def max_group_size(self) -> int:
        return max((b - a for a, b in zip(self.starts, self.starts[1:], strict=False)), default=0)

    def group(self, index: int) -> list[int]:
        return self.rows[self.starts[index] : self.starts[index + 1]]


def group_rows(row_slots: list[int]) -> SlotGroups:
    """row_slots [T]: each row's slot, -1 for the base model -> its rows grouped by slot."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(row)
    slots = sorted(by_slot)
    rows = [row for slot in slots for row in by_slot[slot]]
    starts = [0]
    for slot in slots:
        starts.append(starts[-1] + len(by_slot[slot]))
    return SlotGroups(slots, rows, starts)


def is_padding_cheap(groups: SlotGroups) -> bool:
    """Whether the padded form wastes at most MAX_PADDING_PER_GROUP rows per group."""
    num_groups = len(groups.slots)
    padding = num_groups * groups.max_group_size - groups.num_rows
    return padding <= MAX_PADDING_PER_GROUP * num_groups


def padded_rows(groups: SlotGroups) -> tuple[list[list[int]], list[int]]:
    """([G, L] each group's rows, padded to the longest by repeating its first row; [M] the
    positions of the real rows in that grid flattened, in `groups.rows` order)."""
    width = groups.max_group_size
    grid: list[list[int]] = []
    positions: list[int] = []
    for index in range(len(groups.slots)):
        rows = groups.group(index)
        grid.append(rows + [rows[0]] * (width - len(rows)))
        positions += range(index * width, index * width + len(rows))
    return grid, positions


def select_rows(row_slots: list[int], rows: list[int]) -> list[int]:
    """The slots of the rows kept (a layer's output rows), in their order."""
    return [row_slots[row] for row in rows]


def slot_runs(row_slots: list[int]) -> list[SlotRun]:
    """The runs of at least MIN_RUN_ROWS consecutive rows of one adapter slot, in row order,
    but only of slots with one such run: several chunks of one adapter (a burst of prompts) run
    cheaper as one group, one matmul pair on their gathered rows, than as a pair per chunk."""
    runs: list[SlotRun] = []
    first = 0
    for row in range(1, len(row_slots) + 1):
        if row < len(row_slots) and row_slots[row] == row_slots[first]:
            continue
        if row_slots[first] >= 0 and row - first >= MIN_RUN_ROWS:
            runs.append(SlotRun(row_slots[first], first, row))
        first = row
    num_runs = Counter(run.slot for run in runs)
    return [run for run in runs if num_runs[run.slot] == 1]


def without_runs(row_slots: list[int], runs: list[SlotRun]) -> list[int]:
    """row_slots with the runs' rows taken out of the groups (as the base model's rows are)."""
    rest = list(row_slots)
    for run in runs:
        rest[run.first : run.end] = [-1] * (run.end - run.first)
    return rest
