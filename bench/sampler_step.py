"""Sampler: one step's sampling time, batched (layers/sampler.py) vs a per-row loop.

    .venv/bin/python -m bench.sampler_step [--num-seqs 64] [--vocab 4096 32000 151936]
        [--device cpu] [--repeats 20]

Both sides get the same logits [S, V] and the same sequences. Three batches of --num-seqs
sequences with contexts of 64 prompt + 0-255 generated tokens: all greedy (the fast path: one
max, one sync); the options the old sampler had (a quarter each greedy, temperature, top-k +
top-p, seeded top-p), against the old sampler's per-row loop (`old_sample` below, as it was
before the batched sampler replaced it); and every option (adding min-p, logit bias, min_tokens
and presence / frequency / repetition penalties), which the old loop cannot do, against the
row-at-a-time reference the sampler is tested against (bench/reference/sampler.py).
Median of --repeats steps, after one warm-up.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

from bench.engine_common import setup_threads, threads_note
from bench.reference.sampler import sample_rows
from bench.report import markdown_table, write_section
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.layers.sampler import SamplingRow, sample

EOS = (2,)
NUM_PROMPT = 64

OLD_OPTIONS: list[dict] = [
    {"temperature": 0},
    {"temperature": 0.8},
    {"temperature": 1.0, "top_k": 40, "top_p": 0.9},
    {"temperature": 0.7, "top_p": 0.95, "seed": 1},
]
ALL_OPTIONS: list[dict] = [
    *OLD_OPTIONS,
    {"temperature": 1.0, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    {"temperature": 0, "repetition_penalty": 1.2, "logit_bias": ((5, 2.0), (9, -5.0))},
    {"temperature": 0.9, "top_k": 50, "repetition_penalty": 1.1, "min_tokens": 300},
]


def make_rows(
    options: list[dict], num_seqs: int, vocab_size: int, device: torch.device
) -> list[SamplingRow]:
    rng = random.Random(0)
    rows = []
    for index in range(num_seqs):
        fields = dict(options[index % len(options)])
        params = SamplingParams(max_tokens=512, **fields)
        ids = [rng.randrange(vocab_size) for _ in range(NUM_PROMPT + rng.randrange(256))]
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(index)
        rows.append(SamplingRow(params, ids, NUM_PROMPT, generator))
    return rows


def old_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The old sampler's filter, one row [V]: top-k by topk, top-p by a full sort."""
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        probs = ordered.softmax(-1)
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(
            0, order, probs.cumsum(-1) - probs >= top_p
        )
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def old_sample(logits: torch.Tensor, rows: list[SamplingRow], shared: torch.Generator) -> list[int]:
    """The old per-row loop: a greedy batch in one max, otherwise each row on its own."""
    if all(row.params.is_greedy for row in rows):
        return list(logits.max(-1).indices.tolist())
    tokens = []
    for row_logits, row in zip(logits, rows, strict=True):
        params = row.params
        if params.is_greedy:
            tokens.append(int(row_logits.argmax()))
            continue
        filtered = old_filter(row_logits / params.temperature, params.effective_top_k, params.top_p)
        generator = row.generator or shared
        tokens.append(int(torch.multinomial(filtered.softmax(-1), 1, generator=generator)))
    return tokens


def step_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of one call (the result is read back to the host, as a step does)."""
    run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(
    batch: tuple[str, list[dict], bool],
    num_seqs: int,
    vocab_size: int,
    device: torch.device,
    repeats: int,
) -> list[object]:
    name, options, is_old = batch
    rows = make_rows(options, num_seqs, vocab_size, device)
    logits = torch.randn(num_seqs, vocab_size, device=device) * 3
    shared = torch.Generator(device=device).manual_seed(0)
    batched = step_seconds(lambda: sample(logits, rows, shared, EOS), device, repeats)
    if is_old:
        per_row = step_seconds(lambda: old_sample(logits, rows, shared), device, repeats)
    else:
        per_row = step_seconds(lambda: sample_rows(logits, rows, EOS), device, repeats)
    return [
        name,
        vocab_size,
        f"{batched * 1e3:.2f} ms",
        f"{per_row * 1e3:.2f} ms ({'old sampler' if is_old else 'reference'})",
        f"{per_row / batched:.1f}x",
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096, 32000, 151936])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    setup_threads()
    device = torch.device(args.device)
    batches: list[tuple[str, list[dict], bool]] = [
        ("all greedy", [{"temperature": 0}], True),
        ("old options mixed", OLD_OPTIONS, True),
        ("all options mixed", ALL_OPTIONS, False),
    ]
    table = [
        compare(batch, args.num_seqs, vocab, device, args.repeats)
        for vocab in args.vocab
        for batch in batches
    ]
    body = "\n\n".join(
        [
            f"{threads_note()} Device {device}; {args.num_seqs} sequences per step, contexts of "
            f"{NUM_PROMPT} prompt + 0-255 generated tokens; median of {args.repeats} steps.",
            markdown_table(
                ["batch", "vocabulary", "batched sampler", "per-row loop", "per-row / batched"],
                table,
            ),
        ]
    )
    command = " ".join(["python -m bench.sampler_step", *argv])
    write_section("sampler_step", "Sampler: batched vs per-row", command, body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
