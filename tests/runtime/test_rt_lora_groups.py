"""The segmented LoRA matmul: a step's rows grouped by slot (pure logic, table-driven), and both
forms of the delta (padded, segmented) against each row's own x @ A @ B."""

from __future__ import annotations

import pytest
import torch

from bench.reference.models import TINY_LLAMA
from kvpilot.runtime.layers import lora, paged_kernel
from kvpilot.runtime.layers.lora import FUSED_GROUPS, LoraBatch, LoraStack
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
from kvpilot.runtime.models.loader import load_model_config
from kvpilot.runtime.models.lora_files import LoraAdapter, module_shape

CFG = load_model_config(TINY_LLAMA)


@pytest.mark.parametrize(
    ("row_slots", "slots", "rows", "starts"),
    [
        ([], [], [], [0]),
        ([-1, -1], [], [], [0]),  # the base model's rows skip LoRA
        ([0, 0, 0], [0], [0, 1, 2], [0, 3]),
        ([2, -1, 0, 2, 0], [0, 2], [2, 4, 0, 3], [0, 2, 4]),  # slot order, rows ascending
        ([5, 3, -1, 3], [3, 5], [1, 3, 0], [0, 2, 3]),  # slots need not start at 0
    ],
)
def test_rows_are_grouped_by_slot(
    row_slots: list[int], slots: list[int], rows: list[int], starts: list[int]
) -> None:
    assert group_rows(row_slots) == SlotGroups(slots, rows, starts)


@pytest.mark.parametrize(
    ("row_slots", "is_cheap"),
    [
        ([0, 1, 2, 3] * 4, True),  # decode: 4 rows per slot, no padding
        ([0] * 3 + [1] * 2 + [2], True),  # 3 padding rows for 3 groups
        ([0] * 6 + list(range(1, 21)), True),  # a Zipf-like decode: 100 padding rows, 21 groups
        ([0] * 100 + [1, 2], False),  # a prefill chunk beside two decodes: 198 for 3 groups
        ([0] * 66 + [1], False),  # 65 padding rows for 2 groups: one more than allowed
        ([0] * 65 + [1], True),  # 64 for 2 groups: the limit
        ([-1] * 50 + [0, 1], True),  # base rows cost the padded form nothing
    ],
)
def test_padding_is_chosen_while_at_most_32_rows_per_group(
    row_slots: list[int], is_cheap: bool
) -> None:
    assert is_padding_cheap(group_rows(row_slots)) is is_cheap


@pytest.mark.parametrize(
    ("row_slots", "grid", "positions"),
    [
        ([0, 1, 0, 1], [[0, 2], [1, 3]], [0, 1, 2, 3]),
        ([0, 0, 0, 1, -1], [[0, 1, 2], [3, 3, 3]], [0, 1, 2, 3]),  # padded with its own row
        ([4, 2, 2], [[1, 2], [0, 0]], [0, 1, 2]),
    ],
)
def test_padded_grid_repeats_each_groups_first_row(
    row_slots: list[int], grid: list[list[int]], positions: list[int]
) -> None:
    assert padded_rows(group_rows(row_slots)) == (grid, positions)


@pytest.mark.parametrize(
    ("row_slots", "runs"),
    [
        ([], []),
        ([0] * 15, []),  # shorter than MIN_RUN_ROWS: grouped with the rest
        ([0] * 16, [SlotRun(0, 0, 16)]),
        ([-1] * 20, []),  # the base model's rows are no run
        ([1, 0, 2] + [2] * 20 + [0] * 16 + [1], [SlotRun(2, 2, 23), SlotRun(0, 23, 39)]),
        # two chunks of slot 1: grouped (one matmul pair), slot 0's alone is a run
        ([1] * 16 + [0] * 16 + [1] * 16, [SlotRun(0, 16, 32)]),
    ],
)
def test_runs_of_one_slot_are_set_apart(row_slots: list[int], runs: list[SlotRun]) -> None:
    assert slot_runs(row_slots) == runs


def test_rows_of_runs_leave_the_groups() -> None:
    row_slots = [1, 0] + [2] * 16 + [0]
    rest = without_runs(row_slots, slot_runs(row_slots))
    assert rest == [1, 0] + [-1] * 16 + [0]
    assert group_rows(rest) == SlotGroups([0, 1], [1, 18, 0], [0, 2, 3])


def test_output_rows_keep_their_slots_in_their_order() -> None:
    assert select_rows([3, -1, 0, 1], [3, 0, 1]) == [1, 3, -1]


def random_adapter(rank: int, seed: int) -> LoraAdapter:
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for module in ("q_proj", "v_proj", "gate_proj", "up_proj"):
        out, in_ = module_shape(CFG, module)
        a = torch.randn(rank, in_, generator=generator)
        weights[(0, module)] = (a, torch.randn(out, rank, generator=generator))
    return LoraAdapter(f"seed{seed}", rank, weights)


def reference_delta(
    adapter: LoraAdapter, modules: tuple[str, ...], x: torch.Tensor
) -> torch.Tensor:
    """x [in] -> the fused projection's delta [out]: each sub-module's x @ A^T @ B^T, or zeros."""
    parts = []
    for module in modules:
        pair = adapter.weights.get((0, module))
        out = module_shape(CFG, module)[0]
        parts.append(torch.zeros(out) if pair is None else (x @ pair[0].t()) @ pair[1].t())
    return torch.cat(parts)


@pytest.fixture(params=["compiled", "tensor ops"])
def compiled(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Which path a decode-like step's groups take: torch.ops.kvpilot.lora_add_ or the padded
    batched matmuls (bench.engine_lora --ab compares them)."""
    is_compiled = request.param == "compiled"
    if is_compiled:
        paged_kernel.load()
    monkeypatch.setattr(lora, "_COMPILED_ROWS", is_compiled)
    return is_compiled


@pytest.mark.parametrize("group", ["qkv", "gate_up"])
@pytest.mark.parametrize(
    ("row_slots", "is_padded", "num_runs"),
    [
        ([0, 1, 2, -1, 1, 0, 2, 2], True, 0),  # decode-like: padded batched matmuls
        ([1, -1] * 70 + [2], False, 0),  # an uneven group: one matmul pair per slot
        ([2, -1, 2], True, 0),  # one slot, not the first: its weights are gathered
        ([0, 2, 1] + [1] * 60 + [-1, 2, 0], True, 1),  # a prefill chunk as a slice, decodes padded
        ([-1] + [2] * 16 + [0] * 20, True, 2),  # runs only: no group at all
    ],
)
def test_delta_of_each_form_is_each_rows_own_adapter(
    group: str,
    row_slots: list[int],
    is_padded: bool,
    num_runs: int,
    compiled: bool,
) -> None:
    modules = FUSED_GROUPS[group]
    stack = LoraStack(CFG, modules, 4, 8, torch.float32, torch.device("cpu"))
    adapters = {slot: random_adapter(rank, slot) for slot, rank in [(0, 8), (1, 4), (2, 2)]}
    for slot, adapter in adapters.items():
        stack.set_slot(slot, adapter, layer=0)
    x = torch.randn(len(row_slots), module_shape(CFG, modules[0])[1])
    base = torch.randn(len(row_slots), sum(stack.outs))
    batch = LoraBatch.of_rows(row_slots, [], torch.device("cpu"))
    assert batch is not None and len(batch.runs) == num_runs
    padded = is_padded and batch.num_rows > 0
    assert batch.compiled is (padded and compiled)
    assert (batch.grid is not None) is (padded and not compiled)
    out = stack.add_delta(base.clone(), x, batch)
    for row, slot in enumerate(row_slots):
        delta = torch.zeros(sum(stack.outs)) if slot < 0 else reference_delta(
            adapters[slot], modules, x[row]
        )  # fmt: skip
        torch.testing.assert_close(out[row], base[row] + delta, rtol=1e-4, atol=1e-4)


def test_a_batch_without_adapter_rows_is_none_and_so_are_its_output_rows() -> None:
    cpu = torch.device("cpu")
    assert LoraBatch.of_rows([-1, -1], [0, 1], cpu) is None
    batch = LoraBatch.of_rows([-1, 0, 0], [0], cpu)
    assert batch is not None and batch.output is None
    batch = LoraBatch.of_rows([-1, 0, 1], [2, 0], cpu)
    assert batch is not None and batch.output is not None
    assert batch.output.rows.tolist() == [0] and batch.output.segments == [(1, 0, 1)]


def test_a_projection_no_adapter_of_the_step_targets_is_left_as_it_is() -> None:
    """qv-only adapters (PEFT's default) leave o_proj untouched: its stack is skipped."""
    stack = LoraStack(CFG, ("o_proj",), 4, 8, torch.float32, torch.device("cpu"))
    stack.set_slot(0, random_adapter(8, 0), layer=0)  # q, v, gate, up: not o
    assert stack.is_targeted == [False] * 4
    o_only = LoraAdapter("o", 2, {(0, "o_proj"): (torch.ones(2, 256), torch.ones(256, 2))})
    stack.set_slot(1, o_only, layer=0)
    x, base = torch.randn(3, 256), torch.randn(3, 256)
    skipped = LoraBatch.of_rows([0, -1, 0], [], torch.device("cpu"))
    assert skipped is not None and stack.add_delta(base.clone(), x, skipped).equal(base)
    applied = LoraBatch.of_rows([0, 1, -1], [], torch.device("cpu"))
    assert applied is not None
    out = stack.add_delta(base.clone(), x, applied)
    assert out[[0, 2]].equal(base[[0, 2]])  # slot 0's row adds zeros, the base row nothing
    torch.testing.assert_close(out[1], base[1] + x[1].sum() * 2)
    stack.set_slot(1, random_adapter(8, 1), layer=0)  # rewritten: no longer targets o
    assert stack.is_targeted == [False] * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", ["qkv", "o", "gate_up"])
def test_the_compiled_rows_round_once_what_float64_adds(
    group: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the model's dtype, slots not starting at 0, rows out of order, some of the base model:
    the op sums in float and rounds once into the output, so each value is float64's on the same
    values within a rounding of the dtype (the tensor ops round u, the delta and the sum)."""
    paged_kernel.load()
    modules, cpu = FUSED_GROUPS[group], torch.device("cpu")
    stack = LoraStack(CFG, modules, 6, 16, dtype, cpu)
    for slot, rank in [(1, 16), (3, 8), (5, 4)]:
        stack.set_slot(slot, random_adapter(rank, slot), layer=0)
    exact = LoraStack(CFG, modules, 6, 16, torch.float64, cpu)  # the same values, in float64
    exact.a, exact.b, exact.is_targeted = stack.a.double(), stack.b.double(), stack.is_targeted
    row_slots = [3, -1, 5, 1, 3, 3, -1, 5, 1, 1, 5]
    x = torch.randn(len(row_slots), module_shape(CFG, modules[0])[1]).to(dtype)
    base = torch.randn(len(row_slots), sum(stack.outs)).to(dtype)
    monkeypatch.setattr(lora, "_COMPILED_ROWS", False)
    padded = LoraBatch.of_rows(row_slots, [], cpu)
    assert padded is not None and padded.grid is not None
    want = exact.add_delta(base.double(), x.double(), padded)
    monkeypatch.setattr(lora, "_COMPILED_ROWS", True)
    batch = LoraBatch.of_rows(row_slots, [], cpu)
    assert batch is not None and batch.compiled
    out = stack.add_delta(base.clone(), x, batch)
    assert out[[1, 6]].equal(base[[1, 6]])  # the base model's rows untouched
    rounding = torch.finfo(dtype).eps  # the gap above 1: twice a rounding's largest error
    summing = 1e-6 * want.abs().max().item()  # float's sums of a few hundred products
    torch.testing.assert_close(out.double(), want, rtol=rounding, atol=summing)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rows": [0, 0]}, "rows lists row 0 twice"),
        ({"rows": [0, 9]}, "rows\\[1\\] = 9 is outside 0..3"),
        ({"slots": [7]}, "slots\\[0\\] = 7 is outside 0..3"),
        ({"starts": [0, 1]}, "starts must run from 0 to the number of rows"),
    ],
)
def test_the_compiled_op_refuses_rows_and_slots_outside_its_tensors(
    change: dict[str, list[int]], message: str
) -> None:
    """Checked before any row is written: nothing outside x, out or the stacks is read."""
    paged_kernel.load()
    stack = LoraStack(CFG, ("o_proj",), 4, 8, torch.float32, torch.device("cpu"))
    plan = {"rows": [0, 2], "starts": [0, 2], "slots": [1], **change}
    x, out = torch.randn(4, 256), torch.zeros(4, 256)
    tensors = [torch.tensor(plan[name]) for name in ("rows", "starts", "slots")]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvpilot.lora_add_(out, x, *tensors, stack.a, stack.b, stack.piece_modules)
    assert out.eq(0).all()
