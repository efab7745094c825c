"""KV tiers below the pool: multi-turn chat whose working set is >= 4x the pool, with and without
the host tier; the same chats after a restart from the disk tier; a workload without reuse.

    .venv/bin/python -m bench.engine_kv_offload [--conversations 32] [--turns 8]
        [--no-reuse-rounds 6]

Multi-turn: each turn's prompt is the conversation so far (earlier prompts and answers) plus a
new user message; the conversations take turns (turn 1 of each, then turn 2 of each, ...), so a
conversation's blocks are evicted from the pool before its next turn. Requests are sent one
after another: TTFT is the prefill, not queueing. Restart: an engine with a disk tier runs the
chats and shuts down; a new engine on the same directory answers each conversation's next turn,
against a cold engine. No reuse: distinct prompts, all submitted at once, tiers as in the
multi-turn run (a host tier that never fills: every evicted block is copied, the worst case),
in rounds that alternate which engine runs first (ABBA), each on fresh engines; the figure is
the median of the rounds' ratios, since the machine's load drifts between runs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.engine_common import (
    clock,
    corpus_ids,
    drain,
    fmt_ratio,
    greedy,
    make_engine,
    median,
    percentile,
    setup_threads,
    threads_note,
)
from bench.report import markdown_table, write_section
from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.engine import Engine

USER_TOKENS = 64
ANSWER_TOKENS = 8
POOL_BLOCKS = 128
HOST_GIB = 0.25  # far more than the working set: the tier never refuses here
DISK_GIB = 0.5


def ttft(engine: Engine, prompt: list[int], request_id: str) -> tuple[float, list[int]]:
    """Seconds to the first token, and the answer's tokens."""
    start = clock()
    engine.add_request(prompt, greedy(ANSWER_TOKENS), request_id)
    first, answer = 0.0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and not first:
                first = clock() - start
            answer += out.new_token_ids
    return first, answer


def chats(engine: Engine, num_convs: int, num_turns: int) -> tuple[list[float], float, list]:
    """TTFT of every turn after the first, total seconds, and each conversation's history."""
    ids = corpus_ids()
    histories: list[list[int]] = [[] for _ in range(num_convs)]
    times: list[float] = []
    start = clock()
    for turn in range(num_turns):
        for conv in range(num_convs):
            offset = (conv * num_turns + turn) * USER_TOKENS
            histories[conv] += ids[offset : offset + USER_TOKENS]
            seconds, answer = ttft(engine, histories[conv], f"{conv}-{turn}")
            histories[conv] += answer
            if turn > 0:
                times.append(seconds)
    return times, clock() - start, histories


@dataclass(frozen=True)
class NoReuseRun:
    tokens_per_second: float
    seconds: float
    copy_seconds: float  # the tiers' copies out of the pool (0 without tiers)


def no_reuse(engine: Engine, num_prompts: int, prompt_tokens: int) -> NoReuseRun:
    """Throughput (prompt + output tokens) for distinct prompts submitted at once."""
    ids = corpus_ids()
    for index in range(num_prompts):
        start = 20000 + index * prompt_tokens
        engine.add_request(ids[start : start + prompt_tokens], greedy(16), str(index))
    started = clock()
    drain(engine)
    seconds = clock() - started
    counts = engine.stats().kv_offload
    copies = 0.0 if counts is None else counts.seconds["pool_to_host"]
    return NoReuseRun(num_prompts * (prompt_tokens + 16) / seconds, seconds, copies)


def no_reuse_rounds(config: dict[str, Any], rounds: int) -> list[tuple[NoReuseRun, NoReuseRun]]:
    """(without tiers, with the host tier) per round, which runs first alternating."""
    tiered = {**config, "kv_offloading_size": HOST_GIB}
    results = []
    for index in range(rounds):
        order = [config, tiered] if index % 2 == 0 else [tiered, config]
        runs = {id(c): measure(c, lambda e: no_reuse(e, 64, 256)) for c in order}
        results.append((runs[id(config)], runs[id(tiered)]))
    return results


def block_bytes(max_model_len: int) -> int:
    """One KV block's bytes in the engine's own dtype (a probe engine sized by a known budget)."""
    probe = make_engine(max_model_len=max_model_len, kv_cache_memory=1 << 26)
    num_blocks = probe.block_manager.num_total_blocks
    probe.shutdown()
    return (1 << 26) // num_blocks


def measure(config: dict[str, Any], run: Callable[[Engine], Any]) -> Any:
    engine = make_engine(**config)
    try:
        return run(engine)
    finally:
        engine.shutdown()


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def next_turns(histories: list[list[int]]) -> list[list[int]]:
    ids = corpus_ids()
    return [
        h + ids[30000 + i * USER_TOKENS : 30000 + (i + 1) * USER_TOKENS]
        for i, h in enumerate(histories)
    ]


def first_turns_ttft(engine: Engine, prompts: list[list[int]]) -> list[float]:
    return [ttft(engine, prompt, f"after-{i}")[0] for i, prompt in enumerate(prompts)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--no-reuse-rounds", type=int, default=6)
    args = parser.parse_args(argv)
    setup_threads()
    max_model_len = 1024
    block = block_bytes(max_model_len)
    pool = {"max_model_len": max_model_len, "kv_cache_memory": POOL_BLOCKS * block}
    host = {**pool, "kv_offloading_size": HOST_GIB}
    working_set = args.conversations * args.turns * (USER_TOKENS + ANSWER_TOKENS) // BLOCK_SIZE
    run_chats = lambda e: chats(e, args.conversations, args.turns)  # noqa: E731
    base_ttft, base_s, histories = measure(pool, run_chats)
    tier_ttft, tier_s, tier_histories = measure(host, run_chats)
    with tempfile.TemporaryDirectory() as directory:
        disk = {
            **pool,
            "kv_offloading_size": 32 * block / 2**30,
            "kv_offloading_disk_path": directory,
            "kv_offloading_disk_size": DISK_GIB,
        }
        measure(disk, run_chats)  # fills the directory, then shuts down
        prompts = next_turns(histories)
        warm = measure(disk, lambda e: first_turns_ttft(e, prompts))
    cold = measure(pool, lambda e: first_turns_ttft(e, prompts))
    rounds = no_reuse_rounds({**pool, "max_num_seqs": 4}, args.no_reuse_rounds)
    ratios = sorted(t.tokens_per_second / b.tokens_per_second for b, t in rounds)
    base_tps = median([b.tokens_per_second for b, _ in rounds])
    tier_tps = median([t.tokens_per_second for _, t in rounds])
    copy_share = median([t.copy_seconds / t.seconds for _, t in rounds])
    p50 = median(tier_ttft) / median(base_ttft)
    p95 = percentile(tier_ttft, 95) / percentile(base_ttft, 95)
    restart, same = median(warm) / median(cold), tier_histories == histories
    rows: list[list[object]] = [
        [
            "multi-turn, without tiers",
            ms(median(base_ttft)),
            ms(percentile(base_ttft, 95)),
            f"{base_s:.2f}",
        ],
        [
            "multi-turn, host tier",
            ms(median(tier_ttft)),
            ms(percentile(tier_ttft, 95)),
            f"{tier_s:.2f}",
        ],
        ["next turn, cold start", ms(median(cold)), ms(percentile(cold, 95)), ""],
        ["next turn, restart on the disk tier", ms(median(warm)), ms(percentile(warm, 95)), ""],
    ]
    body = (
        threads_note()
        + f" tiny-llama; a pool of {POOL_BLOCKS} blocks ({POOL_BLOCKS * BLOCK_SIZE} tokens); "
        f"{args.conversations} conversations x {args.turns} turns of {USER_TOKENS} user + "
        f"{ANSWER_TOKENS} answer tokens: a working set of {working_set} blocks "
        f"({working_set / POOL_BLOCKS:.1f}x the pool). Host tier {HOST_GIB} GiB; the restart "
        f"run: a host tier of 32 blocks over a {DISK_GIB} GiB disk tier. TTFT over turns 2..N; "
        "times are the process's CPU time (bench.engine_common.clock).\n\n"
        + markdown_table(["run", "TTFT p50 (ms)", "TTFT p95 (ms)", "total (s)"], rows)
        + f"\n\nHost tier, TTFT p50: {p50:.2f}x, p95: {p95:.2f}x without (target <= 0.5x: "
        f"{'met' if max(p50, p95) <= 0.5 else 'not met'}).  \n"
        f"Host tier, throughput: {fmt_ratio(base_s / tier_s, 1.2)}.  \n"
        f"Greedy answers identical with and without the host tier: {same}.  \n"
        f"Restart on the disk tier, next-turn TTFT p50: {restart:.2f}x a cold start's "
        f"(target <= 0.5x: {'met' if restart <= 0.5 else 'not met'}).  \n"
        f"No reuse (64 distinct 256-token prompts, 16 output tokens, 4 at a time; "
        f"{len(rounds)} alternating rounds): median {base_tps:.0f} tokens/s without tiers, "
        f"{tier_tps:.0f} with; median of the rounds' ratios "
        f"{fmt_ratio(median(ratios), 0.97)}, the rounds' ratios "
        f"{', '.join(f'{r:.2f}' for r in ratios)}. The tier's copies out of the pool (every "
        f"evicted block: the tier never fills) took a median {copy_share:.1%} of the tiered "
        "run's time (kvpilot_kv_offload_seconds_total{transfer_type=pool_to_host}, wall "
        "seconds, over the run's CPU seconds)."
    )
    command = " ".join(["python -m bench.engine_kv_offload", *argv])
    write_section(
        "engine_kv_offload", "Engine: KV tiers below the pool (host, disk)", command, body
    )
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
