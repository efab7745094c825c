"""Decode graphs' CPU-testable core (engine/decode_graphs.py): buckets, padding, static buffers,
and the real model run through the padded static path eagerly, against the unpadded step: the
same greedy tokens and the same real KV blocks, padding rows touching the scratch block only.
The CUDA capture replays exactly this path (bench/gpu/check.py checks it on a GPU)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.decode_graphs import (
    SDPA_GRAPH_GATHER_BYTES,
    DecodeBuffers,
    StaticDecode,
    batch_buckets,
    choose_bucket,
    graph_rows,
    graphs_off_reason,
    pad_decode,
    sdpa_buckets,
)
from kvpilot.runtime.engine.model_runner import (
    ModelRunner,
    PrefillPlan,
    StepPlan,
    load_model,
    plan_step,
)
from kvpilot.runtime.engine.scheduler import ScheduledSequence
from kvpilot.runtime.engine.sequence import Sequence
from kvpilot.runtime.models.llama import LlamaModel
from kvpilot.runtime.models.loader import load_model_config

NUM_BLOCKS = 48
MAX_BLOCKS = 8  # the graphs' table width: contexts up to 128 tokens


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [
        (1, (1,)),
        (2, (1, 2)),
        (3, (1, 2, 3)),
        (8, (1, 2, 4, 8)),
        (10, (1, 2, 4, 8, 10)),
        (40, (1, 2, 4, 8, 16, 24, 32, 40)),
        (42, (1, 2, 4, 8, 16, 24, 32, 40, 42)),
    ],
)
def test_batch_buckets_are_vllms_capture_sizes_up_to_max_num_seqs(
    max_num_seqs: int, expected: tuple[int, ...]
) -> None:
    assert batch_buckets(max_num_seqs) == expected


def test_batch_buckets_refuse_an_empty_batch() -> None:
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        batch_buckets(0)


@pytest.mark.parametrize(
    ("num_rows", "expected"), [(1, 1), (2, 2), (3, 4), (5, 8), (9, 10), (10, 10), (11, None)]
)
def test_choose_bucket_is_the_smallest_that_holds_the_rows(
    num_rows: int, expected: int | None
) -> None:
    assert choose_bucket((1, 2, 4, 8, 10), num_rows) == expected


def test_sdpa_buckets_stop_where_the_gather_outgrows_its_budget() -> None:
    row_bytes = SDPA_GRAPH_GATHER_BYTES // 16  # 16 rows fit exactly
    buckets = sdpa_buckets(batch_buckets(64), max_blocks=1, block_bytes=row_bytes // 2)
    assert buckets == (1, 2, 4, 8, 16)
    assert sdpa_buckets((1, 2), max_blocks=1, block_bytes=SDPA_GRAPH_GATHER_BYTES) == (1,)


def decode_plan(contexts: list[int], first_block: int = 0) -> StepPlan:
    """A decode step over sequences with these context lengths (own token included), each on
    consecutive blocks from `first_block` on."""
    tables, block = [], first_block
    for length in contexts:
        num_blocks = -(-length // BLOCK_SIZE)
        tables.append(list(range(block, block + num_blocks)))
        block += num_blocks
    slots = [t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
             for t, n in zip(tables, contexts, strict=True)]  # fmt: skip
    rows = list(range(len(contexts)))
    return StepPlan(
        input_ids=[7 + row for row in rows], positions=[n - 1 for n in contexts],
        slot_mapping=slots, decode_block_tables=tables, decode_context_lens=list(contexts),
        prefills=[], sample_rows=rows,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({}, 3),
        ({"prefills": [PrefillPlan(3, 4, 0, [9])]}, None),  # a mixed step runs eagerly
        ({"prompt_rows": [0], "prompt_spans": [("a", 0, 1)]}, None),  # prompt logprobs
        ({"lora_slots": [0, -1, -1]}, None),  # an adapter's rows
        ({"decode_block_tables": [[0] * (MAX_BLOCKS + 1), [1], [2]]}, None),  # wider than graphs
    ],
    ids=["decodes", "prefill", "prompt-logprobs", "lora", "too-wide"],
)
def test_graph_rows_take_plain_decode_steps_only(
    change: dict[str, object], expected: int | None
) -> None:
    plan = replace(decode_plan([5, 17, 40]), **change)  # type: ignore[arg-type]
    assert graph_rows(plan, MAX_BLOCKS) == expected
    empty = StepPlan([], [], [], [], [], [], [])
    assert graph_rows(empty, MAX_BLOCKS) is None


def test_padding_rows_write_and_read_the_scratch_block_only() -> None:
    plan, scratch = decode_plan([5, 17, 40]), NUM_BLOCKS
    padded = pad_decode(plan, 8, MAX_BLOCKS, scratch)
    assert padded.input_ids == plan.input_ids + [0] * 5
    assert padded.positions == plan.positions + [0] * 5
    assert padded.slot_mapping[:3] == plan.slot_mapping
    assert padded.slot_mapping[3:] == [scratch * BLOCK_SIZE] * 5  # the scratch block's first slot
    assert padded.context_lens == [5, 17, 40] + [1] * 5  # a padding row sees its own key only
    for table, real in zip(padded.block_tables, plan.decode_block_tables, strict=False):
        assert table == real + [scratch] * (MAX_BLOCKS - len(real))
    assert padded.block_tables[3:] == [[scratch] * MAX_BLOCKS] * 5
    with pytest.raises(ValueError, match="3 decode rows do not fit bucket 2"):
        pad_decode(plan, 2, MAX_BLOCKS, scratch)


def test_buffers_are_filled_in_place_and_metadata_views_them() -> None:
    buffers = DecodeBuffers(8, MAX_BLOCKS, torch.device("cpu"))
    addresses = [t.data_ptr() for t in (buffers.input_ids, buffers.block_tables)]
    for contexts in ([5, 17, 40], [33, 2]):  # two steps, different batches
        padded = pad_decode(decode_plan(contexts, first_block=3), 4, MAX_BLOCKS, NUM_BLOCKS)
        buffers.fill(padded)
        assert [t.data_ptr() for t in (buffers.input_ids, buffers.block_tables)] == addresses
        assert buffers.input_ids[:4].tolist() == padded.input_ids
        assert buffers.context_lens[:4].tolist() == padded.context_lens
        assert buffers.block_tables[:4].tolist() == padded.block_tables
    meta = buffers.metadata(4, torch.float32, None)
    assert meta.slot_mapping.data_ptr() == buffers.slot_mapping.data_ptr()
    (group,) = meta.decodes
    assert group.block_ids.data_ptr() == buffers.block_tables.data_ptr()  # a view, not a copy
    visible = (group.mask[:, 0, 0] == 0).sum(-1).tolist()
    assert visible == [33, 2, 1, 1]  # the second step's rows, then padding


@pytest.mark.parametrize(
    ("enforce_eager", "device", "tp", "expected"),
    [
        (False, "cuda", 1, None),
        (True, "cuda", 1, "--enforce-eager"),
        (False, "cpu", 1, "CUDA-only"),
        (True, "cpu", 1, "--enforce-eager"),
        (False, "cuda", 2, "tensor parallelism"),
    ],
)
def test_graphs_off_reason(enforce_eager: bool, device: str, tp: int, expected: str | None) -> None:
    reason = graphs_off_reason(enforce_eager, torch.device(device), tp)
    assert reason is None if expected is None else expected in str(reason)


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir: Path) -> LlamaModel:
    cfg = load_model_config(tiny_llama_dir)
    return load_model(tiny_llama_dir, cfg, "none", torch.float32, torch.device("cpu"))


def runner_of(model: LlamaModel, cuda_graphs: bool) -> ModelRunner:
    runner = ModelRunner(model, torch.device("cpu"), seed=0, cuda_graphs=cuda_graphs)
    runner.allocate_kv_cache(NUM_BLOCKS)
    generator = torch.Generator().manual_seed(1)
    for k_cache, v_cache in runner.kv_caches:  # garbage everywhere: a stray write shows
        for cache in (k_cache, v_cache):
            real = cache.data[:NUM_BLOCKS]  # the same in both runners
            real.copy_(torch.randn(real.shape, generator=generator))
            cache.data[NUM_BLOCKS:].fill_(0.5)  # the scratch block, if any
    return runner


# (prompt length, decode steps) per sequence: the batch shrinks 5 -> 3 -> 1 rows, so decode steps
# run in buckets 8, 4 and 1 (padding rows in the first two).
SEQUENCES = [(5, 3), (17, 9), (40, 3), (3, 9), (60, 12)]


def greedy_run(
    runner: ModelRunner, decode: Callable[[StepPlan], torch.Tensor]
) -> tuple[list[list[int]], list[int]]:
    """Prefill SEQUENCES, then decode greedily through `decode`; (tokens per sequence, the
    blocks they used)."""
    free = list(range(NUM_BLOCKS))
    random.Random(0).shuffle(free)
    seqs = []
    for index, (length, steps) in enumerate(SEQUENCES):
        seq = Sequence(str(index), [(7 * index + 3 * i) % 200 + 3 for i in range(length)])
        num_blocks = -(-(length + steps) // BLOCK_SIZE)
        seq.block_table, free = free[:num_blocks], free[num_blocks:]
        seqs.append(seq)
    step = [ScheduledSequence(seq, seq.num_tokens) for seq in seqs]
    hidden = runner.hidden(plan_step(step))  # the prefill: no graph holds it, so eager
    while step:
        tokens = runner.model.compute_logits(hidden).argmax(-1).tolist()
        for item, token in zip(step, tokens, strict=True):
            item.seq.num_computed_tokens += item.num_new_tokens
            item.seq.token_ids.append(token)
        step = [ScheduledSequence(seq, 1)
                for seq, (_, steps) in zip(seqs, SEQUENCES, strict=True)
                if seq.num_output_tokens <= steps]  # fmt: skip
        if step:
            hidden = decode(plan_step(step))
    used = sorted(block for seq in seqs for block in seq.block_table)
    return [seq.output_token_ids for seq in seqs], used


@pytest.mark.slow
def test_padded_static_decode_equals_the_unpadded_step(tiny_model: LlamaModel) -> None:
    eager = runner_of(tiny_model, cuda_graphs=False)
    padded = runner_of(tiny_model, cuda_graphs=True)
    scratch = padded.num_kv_blocks
    assert padded.kv_caches[0][0].data.shape[0] == NUM_BLOCKS + 1 and scratch == NUM_BLOCKS
    before = [cache.data.clone() for layer in padded.kv_caches for cache in layer]
    static = StaticDecode(tiny_model, padded.kv_caches, batch_buckets(8), MAX_BLOCKS, scratch)
    buckets_used: list[int] = []

    class EagerGraphs:
        """The graphs' path run without a capture, where run_model looks for graphs."""

        def run(self, plan: StepPlan) -> torch.Tensor | None:
            buckets_used.append(static.bucket_for(plan) or 0)
            return static.run_eager(plan)

    padded.graphs = EagerGraphs()
    expected, used = greedy_run(eager, eager.run_model)
    got, _ = greedy_run(padded, padded.run_model)
    assert got == expected
    assert {8, 4, 1} <= set(buckets_used)  # padding rows ran (buckets 8 and 4)
    unused = [b for b in range(NUM_BLOCKS) if b not in used]
    assert unused, "the test needs blocks no sequence holds"
    after = [cache.data for layer in padded.kv_caches for cache in layer]
    references = [cache.data for layer in eager.kv_caches for cache in layer]
    for old, new, reference in zip(before, after, references, strict=True):
        assert torch.equal(new[unused], old[unused])  # no stray write into a real block
        torch.testing.assert_close(new[used], reference[used], rtol=1e-5, atol=1e-5)
        assert not torch.equal(new[scratch], old[scratch])  # the padding rows wrote here


def test_static_decode_needs_the_scratch_block_in_the_pool(tiny_model: LlamaModel) -> None:
    runner = runner_of(tiny_model, cuda_graphs=False)
    with pytest.raises(ValueError, match=r"outside the KV pool.*cuda_graphs=True"):
        StaticDecode(tiny_model, runner.kv_caches, (1, 2), MAX_BLOCKS, runner.num_kv_blocks)
