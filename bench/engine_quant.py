"""Quantisation: weight bytes and perplexity loss per level on the tiny-llama eval split.

.venv/bin/python -m bench.engine_quant
"""

from __future__ import annotations

import sys

from bench.engine_common import MODEL, setup_threads, threads_note
from bench.report import markdown_table, write_section
from kvpilot.runtime.evaluate import parse_args, run

TARGETS = {"bf16": (1.0, 0.0), "int8": (0.52, 0.01), "int4": (0.30, 0.10)}


def verdict(is_met: bool) -> str:
    return "met" if is_met else "not met"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    setup_threads()
    dataset = MODEL / "eval.txt"
    result = run(parse_args(["--model", str(MODEL), "--dataset", str(dataset), *argv]))
    bf16_bytes = result["levels"]["bf16"]["weight_bytes"]
    rows: list[list[object]] = [
        [
            "none (fp32 compute, baseline)",
            f"{result['baseline']['perplexity']:.3f}",
            "-",
            f"{result['baseline']['weight_bytes'] / 2**20:.2f}",
            "-",
        ],
    ]
    for level, row in result["levels"].items():
        max_ratio, max_loss = TARGETS[level]
        ratio = row["weight_bytes"] / bf16_bytes
        loss = row["relative_loss"]
        rows.append(
            [
                level,
                f"{row['perplexity']:.3f}",
                f"{loss:+.2%} (target <= {max_loss:.0%}: {verdict(loss <= max_loss)})",
                f"{row['weight_bytes'] / 2**20:.2f}",
                f"{ratio:.3f} (target <= {max_ratio}: {verdict(ratio <= max_ratio)})",
            ]
        )
    body = (
        threads_note()
        + " "
        + (
            f"Model models/tiny-llama ({result['num_tokens']} held-out tokens of models/tiny-llama/"
            "eval.txt, 512-token windows). Embeddings and lm_head are quantised too (tied).\n\n"
            + markdown_table(
                ["level", "perplexity", "relative loss", "weight MiB", "bytes vs bf16"], rows
            )
        )
    )
    command = " ".join(["python -m bench.engine_quant", *argv])
    write_section("engine_quant", "Engine: weight-only quantisation", command, body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
