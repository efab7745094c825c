"""Tensor parallelism on CPU (gloo, 2 ranks) against the single-process engine on tiny-llama
(8 attention heads, 2 KV heads): same logits, same greedy tokens, int8, int4 and fp8 KV too, a clear
error when the heads do not divide, and no worker left behind, whether the engine shuts down or
dies.

One tensor-parallel engine runs in a process at a time (torch.distributed has one default group),
so each test starts and shuts down its own.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvpilot.runtime.engine.draft_model import DraftModelProposer
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.scheduler import ScheduledSequence
from kvpilot.runtime.engine.sequence import Sequence
from kvpilot.runtime.layers.quant import (
    DenseWeight,
    Int4Weight,
    Int8DynamicWeight,
    Int8Weight,
    Weight,
)
from tests.support.processes import is_gone

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

# A rank's o_proj/down_proj product is a partial sum over half the features; the all-reduce adds
# the halves, so float32 rounds in a different order than one full matmul. Measured: at most
# 2e-6 on logits up to ~8 here. 1e-4 is the bound test_rt_logits holds us to against
# transformers, i.e. the runtime's own definition of "the same model"; a missing all-reduce or a
# wrong shard is off by far more (order 1).
LOGITS_ATOL = 1e-4
# The int kernels take bf16 activations and give bf16 products, so a rank's partial sum is
# rounded before the all-reduce adds it: measured at most 0.0072 on these logits (int4, int8).
# A wrong shard (a misplaced scale, group or output) is off by order 1.
PACKED_LOGITS_ATOL = 0.03
PROMPTS = [
    "The for statement is used to iterate over",
    "Once upon a time",
    "A class definition is an executable statement that",
]
CHUNK = 4  # tokens per sequence per step: prompts of 9, 7, 9 tokens take 2-3 steps, over cached KV
NUM_STEPS = 5
NUM_TOKENS = 8
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def tp1(make_engine: Callable[..., Engine]) -> Engine:
    return make_engine(enable_prefix_caching=False)


@contextlib.contextmanager
def tp_engine(make_engine: Callable[..., Engine], **kwargs: object) -> Iterator[Engine]:
    engine = make_engine(tensor_parallel_size=2, enable_prefix_caching=False, **kwargs)
    try:
        yield engine
    finally:
        engine.shutdown()


def step_logits(engine: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Drive the runner directly: chunked prefill, then greedy decodes; each step's logits
    [S, vocab] of the rows that sample (the engine's own step hides them)."""
    bm = engine.block_manager
    seqs = [Sequence(f"logits-{i}", list(p)) for i, p in enumerate(prompts)]
    steps = []
    for _ in range(NUM_STEPS):
        batch = []
        for seq in seqs:
            size = min(CHUNK, seq.num_tokens - seq.num_computed_tokens)
            bm.allocate_slots(seq, size)
            batch.append(ScheduledSequence(seq, size))
        sampling = [item.seq for item in batch if item.is_sampling]
        logits = engine.runner.logits(batch)  # [S, vocab]
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens
        for seq, token in zip(sampling, logits.argmax(dim=-1).tolist(), strict=True):
            seq.append_token(token)
        steps.append(logits)
    for seq in seqs:
        bm.free(seq)
    return steps


def greedy_tokens(engine: Engine) -> dict[str, list[int]]:
    """All prompts in one batch through the engine's own step loop."""
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params, f"greedy-{i}")
    tokens: dict[str, list[int]] = {f"greedy-{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def test_tp2_logits_and_greedy_tokens_match_one_process(
    tp1: Engine, make_engine: Callable[..., Engine]
) -> None:
    prompts = [tp1.tokenizer.encode(p) for p in PROMPTS]
    reference = step_logits(tp1, prompts)
    with tp_engine(make_engine) as tp2:
        steps = step_logits(tp2, prompts)
        tokens = greedy_tokens(tp2)
        # each rank's pool holds 1 of the 2 KV heads, so the same budget holds twice the blocks
        assert tp2.runner.kv_caches[0][0].data.shape[2] == 1
        assert tp2.num_kv_blocks == 2 * tp1.num_kv_blocks
    assert [s.shape[0] for s in reference] == [0, 1, 3, 3, 3]  # prompts finish in steps 2-3
    for ours, theirs in zip(steps, reference, strict=True):
        torch.testing.assert_close(ours, theirs, atol=LOGITS_ATOL, rtol=0)
    assert tokens == greedy_tokens(tp1)


def test_tp2_with_a_draft_model_on_rank_0_matches_tp1(
    tp1: Engine, make_engine: Callable[..., Engine], tiny_llama_dir: Path
) -> None:
    """The draft runs whole on rank 0 beside its shard of the served model (vLLM's draft with
    draft_tensor_parallel_size 1): the same greedy tokens, its proposals accepted, and rank 0's
    pool sized for half the served model's KV and all the draft's per block."""
    config = json.dumps(
        {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    )
    with tp_engine(make_engine, speculative_config=config) as tp2:
        tokens = greedy_tokens(tp2)
        stats = tp2.stats()
        draft = tp2.proposer
        assert isinstance(draft, DraftModelProposer)
        assert draft.runner.kv_caches[0][0].data.shape[2] == 2  # both of the draft's KV heads
        assert tp2.runner.kv_caches[0][0].data.shape[2] == 1  # one of the served model's
        # per block: half the served model's bytes and the whole draft's, 1.5x of one process's
        assert abs(tp2.num_kv_blocks - tp1.num_kv_blocks / 1.5) <= 1
    assert tokens == greedy_tokens(tp1)
    assert stats.spec_decode_draft_tokens > 0
    assert stats.spec_decode_accepted_tokens >= 0.99 * stats.spec_decode_draft_tokens, stats


@pytest.mark.parametrize(
    ("kwargs", "weight_type"),
    [
        ({"quantization": "int8", "int8_kernel": "w8a16"}, Int8Weight),
        ({"quantization": "int8", "int8_kernel": "w8a8"}, Int8DynamicWeight),
        ({"quantization": "int4"}, Int4Weight),
        ({"kv_cache_dtype": "fp8"}, DenseWeight),
    ],
    ids=["int8-w8a16", "int8-w8a8", "int4", "fp8-kv"],
)
def test_tp2_quantised_greedy_matches_tp1(
    make_engine: Callable[..., Engine], kwargs: dict[str, str], weight_type: type[Weight]
) -> None:
    """Shard first, then quantise. int8 scales are per output channel, so the column-parallel
    shards quantise exactly as the whole matrix does, while o_proj/down_proj shards get scales of
    their own half of the inputs (int4: groups of 128 of their half): no worse, not identical,
    hence greedy tokens, not bits, must agree. fp8 KV has one fixed scale, whatever the heads."""
    expected = greedy_tokens(make_engine(enable_prefix_caching=False, **kwargs))
    with tp_engine(make_engine, **kwargs) as tp2:
        layer = tp2.runner.model.layers[0]
        assert isinstance(layer.down.weight, weight_type)
        assert layer.down.weight.dequantize(torch.float32).shape == (256, 344)  # [hidden, I / 2]
        assert tp2.runner.kv_caches[0][0].data.dtype == tp2.kv_dtype
        assert greedy_tokens(tp2) == expected


@pytest.mark.parametrize(
    ("variant", "down_type", "atol"),
    [
        ("int4-channel", Int4Weight, PACKED_LOGITS_ATOL),
        ("int4-g128", DenseWeight, PACKED_LOGITS_ATOL),
        # weight-only: w8a8 would quantise each rank's half of o_proj's and down_proj's input
        # with a scale of its own, a near-tie's token apart (test_tp2_quantised_greedy_...)
        ("int8-channel", Int8Weight, PACKED_LOGITS_ATOL),
        ("fp8-channel", DenseWeight, LOGITS_ATOL),  # dequantised at load: float32 matmuls
    ],
)
def test_tp2_serves_a_pre_quantised_checkpoint_as_one_process_does(
    make_engine: Callable[..., Engine],
    tmp_path: Path,
    variant: str,
    down_type: type[Weight],
    atol: float,
) -> None:
    """Each rank reads its share of the packed tensors and keeps them packed (int4-g128 leaves
    down_proj bf16, fp8 is dequantised at load): the same logits as the checkpoint in one
    process, to the all-reduce's rounding, the same greedy tokens."""
    from bench.reference.prequantized import write_checkpoint

    path = write_checkpoint(tmp_path / variant, variant)
    kernel = {"int8_kernel": "w8a16"} if variant.startswith("int8") else {}
    tp1 = make_engine(path, enable_prefix_caching=False, **kernel)
    prompts = [tp1.tokenizer.encode(p) for p in PROMPTS]
    reference, expected = step_logits(tp1, prompts), greedy_tokens(tp1)
    tp1.shutdown()
    with tp_engine(make_engine, model=path, **kernel) as tp2:
        layer = tp2.runner.model.layers[0]
        assert isinstance(layer.down.weight, down_type)
        assert layer.down.weight.dequantize(torch.float32).shape == (256, 344)  # [hidden, I / 2]
        steps, tokens = step_logits(tp2, prompts), greedy_tokens(tp2)
    for ours, theirs in zip(steps, reference, strict=True):
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)
    assert tokens == expected


def test_heads_not_dividing_is_a_clear_error_and_starts_no_process(
    make_engine: Callable[..., Engine],
) -> None:
    before = set(mp.active_children())
    with pytest.raises(ValueError) as error:
        make_engine(tensor_parallel_size=3)
    message = str(error.value)
    assert "tensor_parallel_size 3" in message
    assert "num_attention_heads 8" in message and "num_key_value_heads 2" in message
    assert set(mp.active_children()) == before


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {DEADLINE_S}s waiting until {what}")
        time.sleep(0.1)


def test_shutdown_stops_and_reaps_the_workers(make_engine: Callable[..., Engine]) -> None:
    with tp_engine(make_engine) as tp2:
        workers = tp2.workers
        assert workers is not None and len(workers.procs) == 1
        pid = workers.pids[0]
        assert not is_gone(pid)
    assert workers.procs[0].exitcode == 0  # left on rank 0's word, not killed
    with pytest.raises(ChildProcessError):  # already reaped: no zombie of ours either
        os.waitpid(pid, os.WNOHANG)
    assert is_gone(pid)
    assert not mp.active_children()


def test_each_rank_computes_with_its_share_of_the_threads(
    make_engine: Callable[..., Engine],
) -> None:
    """Two ranks on the cores one process was given take half each, rank 0 included (each
    taking them all put two threads on every core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with tp_engine(make_engine) as tp2:
            assert tp2.workers is not None
            assert tp2.num_threads == torch.get_num_threads() == 1
            assert tp2.workers.thread_counts() == [1]
            tokens = greedy_tokens(tp2)  # the workers still follow steps after the query
            assert all(len(ids) == NUM_TOKENS for ids in tokens.values())
    finally:
        torch.set_num_threads(before)


def test_a_dead_worker_fails_the_step_with_its_rank(make_engine: Callable[..., Engine]) -> None:
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    with tp_engine(make_engine) as tp2:
        assert tp2.workers is not None
        tp2.add_request(PROMPTS[0], params, "doomed")
        tp2.step()
        os.kill(tp2.workers.pids[0], signal.SIGKILL)
        tp2.workers.procs[0].join()
        with pytest.raises(RuntimeError, match=r"rank 1 is gone \(exit code -9\)"):
            tp2.step()  # at once, not after a collective's timeout


RANK0_SCRIPT = """
import sys, time
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.draft_model import DraftModelProposer
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.layers.quant import DenseWeight, Int4Weight, Int8Weight, Weight
engine = Engine(EngineConfig(model=sys.argv[1], device="cpu", max_model_len=256,
                             kv_cache_memory=4 * 2**20, tensor_parallel_size=2))
print(engine.workers.pids[0], engine.workers.store_dir, flush=True)
time.sleep(600)
"""


def test_workers_exit_when_rank0_is_killed(tiny_llama_dir: Path) -> None:
    rank0 = subprocess.Popen(
        [sys.executable, "-c", RANK0_SCRIPT, str(tiny_llama_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rank0.stdout is not None
    pid_text, store_dir = rank0.stdout.readline().split()
    worker_pid = int(pid_text)
    try:
        assert not is_gone(worker_pid)
        os.kill(rank0.pid, signal.SIGKILL)  # no shutdown, no atexit: only the worker can notice
        rank0.wait()
        wait_until(lambda: is_gone(worker_pid), f"worker {worker_pid} exits")
        wait_until(lambda: not Path(store_dir).exists(), f"the worker removes {store_dir}")
    finally:
        rank0.kill()
        rank0.wait()
        if not is_gone(worker_pid):  # the test failed: do not leave the orphan running
            os.kill(worker_pid, signal.SIGKILL)
