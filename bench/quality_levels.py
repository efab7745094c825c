"""Quality loss per quantisation level for tiny-llama with each eval metric: the figures the
operator admits levels by (spec.quantization.evaluation, quality/admission.py).

Runs the real `kvpilot-runtime eval` (a subprocess, as an eval Job does) once per metric on
models/tiny-llama: perplexity and agreement on its held-out eval.txt; exact-match on prompt/answer
pairs this script writes, whose answers are the unquantised model's own greedy continuations
(so the baseline gets them, and a level's loss is the share of those answers it no longer gives).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.report import markdown_table, write_section
from kvpilot.runtime.engine.model_runner import load_model
from kvpilot.runtime.evaluate import window_logits
from kvpilot.runtime.models.loader import load_model_config
from kvpilot.runtime.models.tokenizer_files import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-llama"
EVAL = MODEL / "eval.txt"
EVAL_BIN = Path(sys.executable).parent / "kvpilot-runtime"
LEVELS = "bf16,int8,int4"


def greedy_pairs(num_prompts: int, num_tokens: int) -> list[dict[str, str]]:
    """Prompts: eval.txt's first sentences of over 20 characters; answers: the unquantised
    model's greedy continuation of `num_tokens` tokens (fp32 on CPU, as the eval's baseline)."""
    tokenizer, cfg = Tokenizer(MODEL), load_model_config(MODEL)
    model = load_model(MODEL, cfg, "none", torch.float32, torch.device("cpu"))
    sentences = [s.strip() for s in EVAL.read_text().split(".") if len(s.strip()) > 20]
    pairs = []
    for prompt in sentences[:num_prompts]:
        ids = tokenizer.encode(prompt)
        start = len(ids)
        for _ in range(num_tokens):
            ids.append(int(window_logits(model, [*ids, 0], torch.device("cpu"))[-1].argmax()))
        pairs.append({"prompt": prompt, "answer": tokenizer.decode(ids[start:])})
    return pairs


def run_eval(dataset: Path, metric: str) -> dict[str, Any]:
    argv = [str(EVAL_BIN), "eval", "--model", str(MODEL), "--dataset", str(dataset)]
    argv += ["--metric", metric, "--quantization", LEVELS, "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout))


def rows(metric: str, result: dict[str, Any]) -> list[list[object]]:
    base = result["baseline"]["value"]
    out: list[list[object]] = [[metric, "none (baseline)", f"{base:.4g}", "-"]]
    for level, row in result["levels"].items():
        out.append([metric, level, f"{row['value']:.4g}", f"{100 * row['relative_loss']:+.2f}%"])
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32, help="exact-match pairs")
    parser.add_argument("--answer-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        pairs = Path(tmp) / "pairs.jsonl"
        made = greedy_pairs(args.prompts, args.answer_tokens)
        pairs.write_text("".join(json.dumps(p) + "\n" for p in made))
        results = {
            "perplexity": run_eval(EVAL, "perplexity"),
            "agreement": run_eval(EVAL, "agreement"),
            "exact-match": run_eval(pairs, "exact-match"),
        }
    table = [r for metric, result in results.items() for r in rows(metric, result)]
    body = "\n\n".join(
        [
            "The relative loss is what `spec.quantization.evaluation.maxQualityLoss` (percent) is"
            " compared with. Each metric's figures come from one run of"
            f" `kvpilot-runtime eval --model models/tiny-llama --quantization {LEVELS} --metric M"
            " --dataset D --json` (fp32 compute on CPU, 512-token windows): D is"
            f" models/tiny-llama/eval.txt ({results['perplexity']['num_tokens']} scored tokens)"
            f" for perplexity and agreement, and for exact-match {len(made)} prompt/answer pairs"
            f" (prompts: eval.txt's first sentences; answers: the unquantised model's greedy"
            f" {args.answer_tokens} tokens, written by this script).",
            markdown_table(["metric", "level", "value", "relative loss"], table),
            "A budget between int8's and int4's loss admits bf16 and int8 only; on the dev"
            " cluster, tests/operator/test_quality_cluster.py sets such a budget on"
            " agreement measured by eval Jobs over eval.txt's first 6000 characters.",
        ]
    )
    command = " ".join(["python -m bench.quality_levels", *argv])
    write_section("quality_levels", "Quality: loss per quantisation level", command, body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
