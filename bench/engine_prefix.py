"""Prefix caching: time to first token with and without the cache, for requests sharing a prefix.

    .venv/bin/python -m bench.engine_prefix [--num-requests 64] [--prefix-tokens 1024]

Requests arrive one after another (each measured alone, so TTFT is prefill time, not queueing).
The exact check: a warm request computes at most its suffix + 16 prompt tokens (one block).
"""

from __future__ import annotations

import argparse
import sys

from bench.engine_common import (
    clock,
    corpus_ids,
    fmt_ratio,
    greedy,
    make_engine,
    median,
    setup_threads,
    threads_note,
)
from bench.report import markdown_table, write_section
from kvpilot.runtime.engine.engine import Engine

SUFFIX_TOKENS = 32


def ttft(engine: Engine, prompt: list[int], request_id: str) -> tuple[float, int]:
    """Seconds to the first token, and prompt tokens served from the cache."""
    start = clock()
    engine.add_request(prompt, greedy(2), request_id)
    first, cached = 0.0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and not first:
                first, cached = clock() - start, out.num_cached_tokens
    return first, cached


def run(num_requests: int, prefix_tokens: int, caching: bool) -> tuple[list[float], list[int]]:
    ids = corpus_ids()
    prefix = ids[:prefix_tokens]
    engine = make_engine(
        enable_prefix_caching=caching,
        max_model_len=prefix_tokens + 2 * SUFFIX_TOKENS,
        max_num_batched_tokens=4096,
    )
    times, cached = [], []
    for index in range(num_requests):
        start = prefix_tokens + 1000 + index * SUFFIX_TOKENS
        seconds, num_cached = ttft(engine, prefix + ids[start : start + SUFFIX_TOKENS], str(index))
        times.append(seconds)
        cached.append(num_cached)
    return times, cached


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    setup_threads()
    cold, _ = run(args.num_requests, args.prefix_tokens, caching=False)
    warm, cached = run(args.num_requests, args.prefix_tokens, caching=True)
    prompt_tokens = args.prefix_tokens + SUFFIX_TOKENS
    computed = [prompt_tokens - c for c in cached[1:]]  # the first request fills the cache
    is_exact = max(computed) <= SUFFIX_TOKENS + 16
    speedup = median(cold[1:]) / median(warm[1:])
    rows: list[list[object]] = [
        ["without prefix cache", f"{median(cold[1:]) * 1000:.1f}", prompt_tokens],
        ["with prefix cache", f"{median(warm[1:]) * 1000:.1f}", max(computed)],
    ]
    body = (
        threads_note()
        + " "
        + (
            f"{args.num_requests} requests, each a shared {args.prefix_tokens}-token prefix + a "
            f"distinct {SUFFIX_TOKENS}-token suffix, sent one after another; p50 over requests "
            "2..N (the first one fills the cache).\n\n"
            + markdown_table(["mode", "TTFT p50 (ms)", "prompt tokens computed (max)"], rows)
            + f"\n\nTTFT speed-up: {fmt_ratio(speedup, 4)}.  \n"
            f"Exact check, warm requests compute <= suffix + 16 = {SUFFIX_TOKENS + 16} prompt "
            f"tokens: {'met' if is_exact else 'not met'} (max {max(computed)})."
        )
    )
    command = " ".join(["python -m bench.engine_prefix", *argv])
    write_section("engine_prefix", "Engine: prefix caching", command, body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
