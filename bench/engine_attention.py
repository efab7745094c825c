"""Engine: decode attention alone, one layer, each way of reading the paged cache (issue 19 item 4).

    .venv/bin/python -m bench.engine_attention [--num-seqs 64] [--contexts 128,512] [--rounds 5]

--num-seqs sequences decode one token each, their blocks shuffled across the pool (as in a
server that has run for a while), bf16, one torch thread, on the runners of tiny-llama (8 heads,
2 KV heads, head size 32) and of the compute-bound Llama of bench.engine_common (16, 4, 64).
Timed per call of one layer (best of --rounds rounds of 20 calls), three ways side by side in one
run:
- `sdpa`: the engine's `--attention-backend sdpa` (layers/attention.paged_attention with the
  runner's decode groups: a gather of each group's blocks, then SDPA with a mask);
- `paged`: the engine's `--attention-backend paged` (the same function, one call of the CPU
  kernel, which reads the blocks where they lie);
- `flex`: torch's flex_attention, compiled, over the whole pool as one key sequence with a
  BlockMask made from the block tables (kv_indices = the table; a mask_mod for the last, partial
  block), as vLLM's FlexAttention backend reads a paged cache; the mask is built outside the
  timing, as an engine would build it once per step for every layer.
Each is checked against the `sdpa` output first.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.engine_common import MODEL, compute_bound_llama, setup_threads, threads_note
from bench.report import command_line, markdown_table, write_section
from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.model_runner import ModelRunner, load_model, plan_step
from kvpilot.runtime.engine.scheduler import ScheduledSequence
from kvpilot.runtime.engine.sequence import Sequence
from kvpilot.runtime.layers import paged_kernel
from kvpilot.runtime.layers.attention import AttentionMetadata, paged_attention
from kvpilot.runtime.layers.kv_cache import PagedCache
from kvpilot.runtime.models.loader import load_model_config

CALLS_PER_ROUND = 20
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


def load_runner(name: str, model_dir: Path) -> tuple[Shape, ModelRunner]:
    """The model's runner; each backend sets `attention_backend` on it (engine_backend)."""
    cfg = load_model_config(model_dir)
    model = load_model(model_dir, cfg, "none", DTYPE, torch.device("cpu"))
    runner = ModelRunner(model, torch.device("cpu"), 0)
    return Shape(name, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), runner


@dataclass
class LayerInputs:
    q: torch.Tensor  # [B, H, D]
    k: torch.Tensor  # [B, H_kv, D], this step's keys and values
    v: torch.Tensor
    k_cache: PagedCache
    v_cache: PagedCache
    batch: list[ScheduledSequence]


def layer_inputs(shape: Shape, num_seqs: int, context: int) -> LayerInputs:
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq + 1
    free = list(range(1, num_blocks))
    random.Random(0).shuffle(free)
    batch = []
    for index in range(num_seqs):
        seq = Sequence(str(index), [0] * (context + 1))
        seq.num_computed_tokens = context
        seq.block_table, free = free[:blocks_per_seq], free[blocks_per_seq:]
        batch.append(ScheduledSequence(seq, 1))
    cache_shape = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    k_cache = PagedCache(torch.randn(cache_shape).to(DTYPE))
    v_cache = PagedCache(torch.randn(cache_shape).to(DTYPE))
    q = torch.randn(num_seqs, shape.num_heads, shape.head_dim).to(DTYPE)
    k, v = torch.randn(2, num_seqs, shape.num_kv_heads, shape.head_dim).to(DTYPE).unbind(0)
    return LayerInputs(q, k, v, k_cache, v_cache, batch)


def engine_backend(
    runner: ModelRunner, shape: Shape, inputs: LayerInputs, backend: str
) -> Callable[[], torch.Tensor]:
    """One layer's decode attention as the engine runs it with `backend`: the runner's own
    metadata for the batch, then layers.attention.paged_attention."""
    runner.attention_backend = backend
    meta: AttentionMetadata = runner.inputs(plan_step(inputs.batch))[2]
    scale = shape.head_dim**-0.5

    def run() -> torch.Tensor:
        return paged_attention(
            inputs.q, inputs.k, inputs.v, inputs.k_cache, inputs.v_cache, meta, scale
        )

    return run


def flex_backend(shape: Shape, inputs: LayerInputs) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    tables = [item.seq.block_table for item in inputs.batch]
    lengths = torch.tensor([item.seq.num_computed_tokens + 1 for item in inputs.batch])
    num_blocks = inputs.k_cache.data.shape[0]
    padded = torch.zeros(len(tables), num_blocks, dtype=torch.int32)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = torch.tensor(table)
    used = torch.tensor([-(-int(n) // BLOCK_SIZE) for n in lengths], dtype=torch.int32)
    last_block = padded.gather(1, (used - 1).long()[:, None]).squeeze(1)
    last_len = (lengths - 1) % BLOCK_SIZE + 1

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return (kv_idx // BLOCK_SIZE != last_block[b]) | (kv_idx % BLOCK_SIZE < last_len[b])

    group = shape.num_heads // shape.num_kv_heads
    block_mask = BlockMask.from_kv_blocks(
        used[:, None, None], padded[:, None, None, :], BLOCK_SIZE=(group, BLOCK_SIZE),
        mask_mod=mask_mod, seq_lengths=(group, num_blocks * BLOCK_SIZE),
    )  # fmt: skip
    pool_shape = (1, num_blocks * BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    keys = inputs.k_cache.data.view(pool_shape).transpose(1, 2)  # [1, H_kv, slots, D]
    values = inputs.v_cache.data.view(pool_shape).transpose(1, 2)
    compiled = torch.compile(flex_attention, dynamic=False)
    num_seqs = inputs.q.shape[0]
    # The G query heads of a KV head are G query rows of one "head": one block of the mask.
    q = inputs.q.view(num_seqs, shape.num_kv_heads, group, shape.head_dim)

    def run() -> torch.Tensor:
        out = compiled(q, keys, values, block_mask=block_mask, scale=shape.head_dim**-0.5)
        return out.reshape(num_seqs, shape.num_heads, shape.head_dim)

    return run


def best_ms(run: Callable[[], torch.Tensor], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(CALLS_PER_ROUND):
            run()
        best = min(best, (time.perf_counter() - started) / CALLS_PER_ROUND)
    return 1000 * best


def measure(
    runner: ModelRunner, shape: Shape, num_seqs: int, context: int, rounds: int
) -> list[object]:
    inputs = layer_inputs(shape, num_seqs, context)
    runs = {
        "sdpa": engine_backend(runner, shape, inputs, "sdpa"),
        "paged": engine_backend(runner, shape, inputs, "paged"),
        "flex": flex_backend(shape, inputs),
    }
    reference = runs["sdpa"]().float()  # writes this step's keys and values first
    for name, run in runs.items():
        error = (run().float() - reference).abs().max().item()
        if error > 0.05:  # bf16 outputs of values ~N(0, 1)
            raise SystemExit(f"{name} differs from sdpa by {error:.3f} ({shape.name}, {context})")
    times = {name: best_ms(run, rounds) for name, run in runs.items()}
    print(f"{shape.name} context {context}: {times}", flush=True)
    sdpa = times["sdpa"]
    return [
        shape.name, context, f"{sdpa:.2f}", f"{times['paged']:.2f}",
        f"{sdpa / times['paged']:.2f}x", f"{times['flex']:.2f}", f"{sdpa / times['flex']:.2f}x",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--contexts", default="128,512", help="tokens already cached per sequence")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    setup_threads()
    paged_kernel.load()
    contexts = [int(part) for part in args.contexts.split(",")]
    table = []
    for name, model_dir in (("tiny-llama", MODEL), ("compute-bound Llama", compute_bound_llama())):
        shape, runner = load_runner(name, model_dir)
        table += [measure(runner, shape, args.num_seqs, c, args.rounds) for c in contexts]
    header = [
        "heads of", "context", "sdpa ms", "paged ms", "paged speed-up", "flex ms", "flex speed-up"
    ]  # fmt: skip
    body = (
        f"{args.num_seqs} sequences, one decode token each, bf16, per call of one layer (best of "
        f"{args.rounds} rounds of {CALLS_PER_ROUND}). {threads_note()}\n\n"
        + markdown_table(header, table)
    )
    command = command_line("bench.engine_attention", argv)
    write_section(
        "engine_attention", "Engine: decode attention, three ways of reading the paged cache",
        command, body,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
