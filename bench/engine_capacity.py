"""KV capacity: concurrent sequences at a fixed KV budget, paged vs contiguous max-length slots.

    .venv/bin/python -m bench.engine_capacity [--num-requests 96] [--kv-mib 24]

Paged: the engine runs the mixed workload (prompts 32-512, outputs 16-256) with every request
queued at once and `max_num_seqs` out of the way; the figure is the peak number of sequences
running together. Contiguous: each sequence reserves max_model_len tokens of KV up front (as a
static per-sequence cache does), so budget // (max_model_len x bytes per token) fit.
"""

from __future__ import annotations

import argparse
import sys

from bench.engine_common import (
    fmt_ratio,
    greedy,
    make_engine,
    mixed_workload,
    setup_threads,
    threads_note,
)
from bench.report import markdown_table, write_section
from kvpilot.contract import memory
from kvpilot.runtime.engine.sizing import model_facts

MAX_MODEL_LEN = 2048


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--kv-mib", type=int, default=24)
    parser.add_argument("--max-output", type=int, default=256)
    args = parser.parse_args(argv)
    setup_threads()
    budget = args.kv_mib * 2**20
    engine = make_engine(
        kv_cache_memory=budget,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=1024,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
    )
    requests = mixed_workload(args.num_requests, (32, 512), (16, args.max_output), seed=1)
    for index, req in enumerate(requests):
        engine.add_request(req.prompt, greedy(req.num_output_tokens), str(index))
    peak_running, preemptions = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        peak_running = max(peak_running, stats.num_running)
        preemptions = stats.num_preemptions
    kv_bytes = engine.runner.kv_caches[0][0].data.element_size()
    per_token = memory.kv_bytes_per_token(model_facts(engine.model_config), kv_bytes)
    contiguous = int(budget // (MAX_MODEL_LEN * per_token))
    rows: list[list[object]] = [
        ["paged (kvpilot, measured peak running)", peak_running],
        [f"contiguous, {MAX_MODEL_LEN}-token slot per sequence", contiguous],
    ]
    body = (
        threads_note()
        + " "
        + (
            f"KV budget {args.kv_mib} MiB ({engine.stats().num_total_blocks} blocks of "
            f"{memory.BLOCK_SIZE} tokens, {per_token} bytes/token), max_model_len {MAX_MODEL_LEN}, "
            f"{len(requests)} requests queued at once (prompts 32-512, "
            f"outputs 16-{args.max_output}),"
            f" {preemptions} preemptions.\n\n"
            + markdown_table(["allocation", "concurrent sequences"], rows)
            + f"\n\nCapacity ratio: {fmt_ratio(peak_running / max(contiguous, 1), 3)}."
        )
    )
    command = " ".join(["python -m bench.engine_capacity", *argv])
    write_section("engine_capacity", "Engine: KV-cache capacity", command, body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
