"""Speculative decoding with a draft model (`{"method": "draft_model", "model": DIR}`): decode
tokens per second with and without it, on running text, for drafts that agree with the served
model more or less often.

    .venv/bin/python -m bench.engine_draft [--rounds 5] [--output-tokens 128] [--no-write]

No trained draft/target pair is on this machine (no model hub), so the drafts are made from
tiny-llama itself: the model as its own draft (accepts every proposal: the mechanism's upper
bound, each draft step costing as much as a served step) and its first two and first one of
four layers (layer-skip self-speculation: cheaper, accepted less often). Prompts as
bench.engine_spec's `plain` (240 tokens of running text), timed from a cold start, prompt
included. Process CPU time with one thread, alternating; tok/s is each one's best round, the
ratio the median of the rounds' ratios (bench.engine_spec.Ratio) with their range.

A second table: requests behind a long common prefix that is warm in the prefix cache, the
model as its own draft, with the draft's KV taken from the cached blocks as the served model's
is (engine/draft_model.py) against the draft recomputing each prompt (its block hashes hidden from
it).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from bench.engine_common import MODEL, corpus_ids, setup_threads, threads_note
from bench.engine_spec import (
    Ratio,
    Run,
    alternating,
    best,
    parse_args,
    prompts,
    run_to_the_end,
)
from bench.reference.models import truncated_llama
from bench.report import command_line, markdown_table, write_section
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.draft_model import DraftModelProposer
from kvpilot.runtime.engine.engine import Engine

CONCURRENCIES = (1, 8)
NUM_SPECULATIVE_TOKENS = 4


def engine(concurrency: int, draft: Path | None) -> Engine:
    spec = None
    if draft is not None:
        spec = json.dumps({"method": "draft_model", "model": str(draft),
                           "num_speculative_tokens": NUM_SPECULATIVE_TOKENS})  # fmt: skip
    return Engine(
        EngineConfig(
            model=str(MODEL), device="cpu", dtype="bfloat16", max_model_len=1024,
            max_num_seqs=concurrency, speculative_config=spec,
        )
    )  # fmt: skip


def cold_run(engine: Engine, batch: list[list[int]], num_tokens: int, round_index: int) -> Run:
    """Prompts this engine's prefix cache has not seen (their first token changed each round),
    timed from their arrival to the last token."""
    batch = [[round_index + 3, *prompt[1:]] for prompt in batch]
    return run_to_the_end(engine, batch, num_tokens, f"run-{round_index}")


def measure(draft: Path, concurrency: int, rounds: int, num_tokens: int) -> dict[str, list[Run]]:
    """Every round of each configuration, the two alternating (which goes first flips)."""
    engines = {"plain": engine(concurrency, None), "draft": engine(concurrency, draft)}
    batch = prompts("plain", concurrency)
    return alternating(
        engines, rounds, lambda engine, index: cold_run(engine, batch, num_tokens, index)
    )


SHARED_PREFIX, SUFFIX, PREFIX_CONCURRENCY = 512, 32, 1


def prefix_batch(round_index: int) -> list[list[int]]:
    """PREFIX_CONCURRENCY prompts: one SHARED_PREFIX-token prefix, suffixes new each round."""
    shared = corpus_ids()[:SHARED_PREFIX]
    suffixes = prompts("plain", PREFIX_CONCURRENCY, seed=round_index + 1)
    return [shared + suffix[:SUFFIX] for suffix in suffixes]


def prefix_rows(rounds: int, num_tokens: int) -> list[tuple[str, ...]]:
    """tok/s behind a warm shared prefix: plain, draft with its KV from the cached blocks, and
    draft recomputing the prefix."""
    engines = {name: engine(PREFIX_CONCURRENCY, None if name == "plain" else MODEL)
               for name in ("plain", "draft, KV from the cache", "draft, recomputed")}  # fmt: skip
    recomputing = engines["draft, recomputed"].proposer
    assert isinstance(recomputing, DraftModelProposer)
    recomputing.blocks = None  # the hashes that let it reuse its KV, hidden
    for name, eng in engines.items():  # warm: the prefix is in every engine's cache
        run_to_the_end(eng, prefix_batch(-1), 4, f"warm-{name}")
    runs = alternating(
        engines,
        rounds,
        lambda eng, index: run_to_the_end(eng, prefix_batch(index), num_tokens, f"r{index}"),
    )
    base = runs["draft, recomputed"]
    rows: list[tuple[str, ...]] = []
    for name, its_runs in runs.items():
        ratio = "1.00x" if name == "draft, recomputed" else str(Ratio.of(its_runs, base))
        run = best(its_runs)
        rows.append((name, f"{run.tok_s:.1f}", ratio, f"{100 * run.acceptance:.0f}%"))
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__)
    setup_threads()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        drafts = {
            "itself (4 of 4 layers)": MODEL,
            "its first 2 layers": truncated_llama(Path(tmp) / "two", 2),
            "its first layer": truncated_llama(Path(tmp) / "one", 1),
        }
        for label, draft in drafts.items():
            for concurrency in CONCURRENCIES:
                runs = measure(draft, concurrency, args.rounds, args.output_tokens)
                plain, spec = best(runs["plain"]), best(runs["draft"])
                ratio = Ratio.of(runs["draft"], runs["plain"])
                rows.append((label, concurrency, f"{plain.tok_s:.1f}", f"{spec.tok_s:.1f}",
                             str(ratio), f"{100 * spec.acceptance:.0f}%",
                             f"{spec.tokens_per_step:.2f}"))  # fmt: skip
                print(rows[-1], flush=True)
    header = ("draft of tiny-llama", "concurrency", "plain tok/s", "draft tok/s",
              "draft / plain (range)", "accepted", "tokens per step")  # fmt: skip
    prefix_header = ("engine", "tok/s", "vs draft recomputing (range)", "accepted")
    prefix_table = markdown_table(prefix_header, prefix_rows(args.rounds, args.output_tokens))
    body = "\n\n".join([intro(args.output_tokens), markdown_table(header, rows), NOTE,
                         prefix_intro(args.output_tokens), prefix_table])  # fmt: skip
    print(body)
    if not args.no_write:
        write_section(
            "engine_draft",
            "Engine: speculative decoding with a draft model",
            command_line("bench.engine_draft", argv),
            body,
        )
    return 0


def intro(num_tokens: int) -> str:
    return (
        f"{threads_note()} bf16 compute. tiny-llama served with a draft model proposing up to "
        f"{NUM_SPECULATIVE_TOKENS} tokens a step, against the same engine without one; "
        f"{num_tokens} output tokens per request (greedy, ignore_eos) after a 240-token prompt "
        "of running text, timed from a cold start (prompt included). tok/s: each one's best "
        "round; `draft / plain`: the median of the rounds' ratios (the two back to back in "
        "each) and their range. `accepted`: the share of "
        "proposed tokens kept; `tokens per step`: output tokens per sequence per engine step."
    )


def prefix_intro(num_tokens: int) -> str:
    return (
        f"Behind a warm prefix: {PREFIX_CONCURRENCY} request(s) at a time (at 8 the governor "
        "keeps a draft as costly as the served model from proposing, as above), each a "
        f"{SHARED_PREFIX}-token prefix every request shares (in the prefix cache from a warm-up "
        f"run) and {SUFFIX} tokens of its own, {num_tokens} output tokens; tiny-llama as its own "
        "draft. `KV from the cache`: the draft starts after the blocks whose KV it wrote before "
        "(engine/draft_model.py); `recomputed`: the same engine with that bookkeeping hidden, so "
        "the draft runs each whole prompt when its sequence first proposes. Ratios as above, "
        "against `recomputed`."
    )


NOTE = (
    "What this shows is the mechanism's cost, not a draft model's gain: tiny-llama's step is "
    "mostly per-call overhead, which a draft step pays again whatever its size, so even a draft "
    "that is always right (the model itself) runs k + 1 model calls for up to k + 1 tokens. A "
    "draft pays where the served model's step is expensive and a much cheaper model agrees with "
    "it often (e.g. a 1 B draft for an 8 B model on a GPU); no such pair is on this machine."
)


if __name__ == "__main__":
    raise SystemExit(main())
