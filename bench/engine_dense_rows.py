"""Engine: decode at one or two sequences with the dense projections in
`torch.ops.kvpilot.dense_rows` (layers/dense_rows.cpp) against F.linear (oneDNN), side by side.

    .venv/bin/python -m bench.engine_dense_rows [--rounds 5] [--decode-steps 32]

Per model and compute dtype, the same engine decodes `concurrency` greedy requests of a 32-token
prompt; once each has its first token, `--decode-steps` steps are timed (tokens per CPU-second of
this process, one torch thread: engine_common.clock), with quant._DENSE_ROWS on and off in turn
within each round. The ratio is the median of the rounds' ratios (each pair back to back), so a
noisy neighbour moves a round, not an arm. Also the projections alone: each of tiny-llama's and
the compute-bound model's matrix shapes at 1-4 rows, microseconds per call, best of 5 batches.
Models: tiny-llama (4 M parameters, where a step is mostly small matmuls and their dispatch) and
the compute-bound random Llama of bench.engine_common (~237 M, bound by reading the weights).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812 - the torch convention

from bench.engine_common import MODEL, compute_bound_llama, setup_threads, threads_note
from bench.engine_quant import decode_tokens_per_second
from bench.report import command_line, markdown_table, write_section
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.layers import paged_kernel, quant

CONCURRENCIES = (1, 2, 4)  # 4: past DENSE_ROWS_MAX, both arms run F.linear (a control)
DTYPES = ("bfloat16", "float32")
# (in, out) of each projection: tiny-llama's q/k/v, o, gate/up, down and lm_head; then the
# compute-bound model's (hidden 1024, intermediate 4096, vocab 4096)
SHAPES = ((256, 384), (256, 256), (256, 1376), (688, 256), (256, 4096), (1024, 4096), (4096, 1024))


class Arms(NamedTuple):
    """One model, dtype and concurrency: each arm's best round, and each round's ratio."""

    dense_rows: float  # tokens per CPU-second
    f_linear: float
    ratios: list[float]  # dense_rows / F.linear, the two back to back in a round


def decode_rates(path: Path, dtype: str, rounds: int, steps: int) -> dict[int, Arms]:
    """Per concurrency, the two arms decoding on one engine, alternating within each round."""
    engine = Engine(
        EngineConfig(model=str(path), dtype=dtype, device="cpu", max_model_len=256,
                     max_num_seqs=max(CONCURRENCIES), max_num_batched_tokens=2048,
                     kv_cache_memory=64 * 2**20)
    )  # fmt: skip
    ratios: dict[int, list[float]] = {c: [] for c in CONCURRENCIES}
    best: dict[tuple[int, bool], float] = {}
    try:
        for _ in range(rounds):
            for concurrency in CONCURRENCIES:
                rates = {}
                for on in (True, False):
                    quant._DENSE_ROWS = on
                    rates[on] = decode_tokens_per_second(engine, concurrency, steps)
                    best[concurrency, on] = max(best.get((concurrency, on), 0.0), rates[on])
                ratios[concurrency].append(rates[True] / rates[False])
    finally:
        quant._DENSE_ROWS = True
    return {c: Arms(best[c, True], best[c, False], ratios[c]) for c in CONCURRENCIES}


def decode_section(rounds: int, steps: int) -> str:
    models = {"tiny-llama (4 M)": MODEL, "compute-bound (~237 M, random)": compute_bound_llama()}
    rows = []
    for name, path in models.items():
        for dtype in DTYPES:
            for concurrency, arms in decode_rates(path, dtype, rounds, steps).items():
                spread = f"{min(arms.ratios):.2f}-{max(arms.ratios):.2f}"
                median = statistics.median(arms.ratios)
                rows.append([name, dtype, concurrency, f"{arms.dense_rows:.1f}",
                             f"{arms.f_linear:.1f}", f"**{median:.2f}x** ({spread})"])  # fmt: skip
    header = ["model", "compute", "concurrency", "dense_rows tok/CPU-s", "F.linear tok/CPU-s",
              "dense_rows / F.linear: median of rounds (range)"]  # fmt: skip
    return markdown_table(header, rows)


def call_us(fn: Callable[[], torch.Tensor], calls: int = 400, batches: int = 5) -> float:
    best = float("inf")
    fn()
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


@torch.inference_mode()
def projection_section() -> str:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for k, n in SHAPES:
            w = torch.randn(n, k, dtype=dtype)
            for num_rows in (1, 2, 3, 4):
                x = torch.randn(num_rows, k, dtype=dtype)
                ops = torch.ops.kvpilot.dense_rows(x, w, None), F.linear(x, w)
                assert torch.allclose(ops[0].float(), ops[1].float(), rtol=0.05, atol=0.05)
                ours = call_us(functools.partial(torch.ops.kvpilot.dense_rows, x, w, None))
                theirs = call_us(functools.partial(F.linear, x, w))
                rows.append([str(dtype).removeprefix("torch."), f"{k} x {n}", num_rows,
                             f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.2f}x"])  # fmt: skip
    header = ["dtype", "in x out", "rows", "dense_rows us", "F.linear us", "speed-up"]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-steps", type=int, default=32)
    args = parser.parse_args(argv)
    setup_threads()
    paged_kernel.load()
    bf16_dot = torch.ops.kvpilot.dense_rows_bf16_dot()
    parts = [
        threads_note(),
        f"dense_rows runs at up to {quant.DENSE_ROWS_MAX} rows; bf16 by bf16 through AVX512-BF16's"
        f" dot product: {'yes' if bf16_dot else 'no (this CPU lacks it: F.linear runs bf16)'}.",
        "### Decode\n\n" + decode_section(args.rounds, args.decode_steps),
        "### The projections alone\n\n" + projection_section(),
    ]
    body = "\n\n".join(parts)
    command = command_line("bench.engine_dense_rows", argv)
    title = "Engine: a decode step's few rows (dense_rows)"
    write_section("engine_dense_rows", title, command, body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
