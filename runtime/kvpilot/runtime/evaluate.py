"""`kvpilot-runtime eval`: perplexity per quantisation level and the relative loss vs unquantised.

    kvpilot-runtime eval --model models/tiny-llama --dataset models/tiny-llama/eval.txt \
        --quantization bf16,int8,int4 [--json]

The baseline is the checkpoint's weights unquantised (`none`); every level runs in the same compute
dtype, so the difference is the weight format alone. Relative loss = ppl(level) / ppl(none) - 1,
the number the operator gates `quantization.maxQualityLoss` on.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the torch convention

from kvpilot.runtime.config import QUANTIZATION_CHOICES
from kvpilot.runtime.engine import resolve_device
from kvpilot.runtime.layers.attention import AttentionMetadata, PrefillSpan
from kvpilot.runtime.loader import load_model_config, resolve_dtype
from kvpilot.runtime.memory import BLOCK_SIZE
from kvpilot.runtime.model_runner import load_model
from kvpilot.runtime.models.llama import LlamaModel
from kvpilot.runtime.tokenizer import Tokenizer


def read_dataset(path: Path) -> str:
    """Plain text, or JSON lines with a `text` field per line."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    if path.suffix == ".jsonl":
        lines = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
        return "\n\n".join(lines)
    return path.read_text()


def windows(token_ids: list[int], max_length: int) -> list[list[int]]:
    """Non-overlapping windows; a trailing window of one token has nothing to predict."""
    chunks = [token_ids[i : i + max_length] for i in range(0, len(token_ids), max_length)]
    return [c for c in chunks if len(c) >= 2]


def relative_loss(perplexity: float, baseline: float) -> float:
    return perplexity / baseline - 1.0


@torch.inference_mode()
def window_nll(model: LlamaModel, ids: list[int], device: torch.device) -> float:
    """Summed negative log-likelihood of ids[1:] given the tokens before each."""
    num_tokens = len(ids)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    cfg = model.cfg
    shape = (num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    caches = [
        (
            torch.zeros(shape, dtype=model.dtype, device=device),
            torch.zeros(shape, dtype=model.dtype, device=device),
        )
        for _ in range(cfg.num_layers)
    ]
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions,
        prefills=[PrefillSpan(0, num_tokens, 0, torch.arange(num_blocks, device=device))],
    )
    tokens = torch.tensor(ids, device=device)
    hidden = model.forward(tokens, positions, caches, meta)  # [T, hidden]
    logits = model.compute_logits(hidden[:-1])  # [T - 1, vocab]
    return float(F.cross_entropy(logits, tokens[1:], reduction="sum"))


def evaluate_level(
    model_dir: Path, quantization: str, chunks: list[list[int]], dtype_name: str, device_name: str
) -> dict[str, Any]:
    cfg = load_model_config(model_dir)
    device = resolve_device(device_name)
    dtype = resolve_dtype(dtype_name, cfg.torch_dtype, device)
    model = load_model(model_dir, cfg, quantization, dtype, device)
    nll = sum(window_nll(model, chunk, device) for chunk in chunks)
    num_targets = sum(len(c) - 1 for c in chunks)
    return {
        "perplexity": math.exp(nll / num_targets),
        "weight_bytes": model.weight_bytes(),
        "num_tokens": num_targets,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = Path(args.model)
    levels = [q.strip() for q in args.quantization.split(",") if q.strip()]
    unknown = [q for q in levels if q not in QUANTIZATION_CHOICES]
    if unknown:
        raise ValueError(f"unknown quantization {unknown}; expected among {QUANTIZATION_CHOICES}")
    token_ids = Tokenizer(model_dir).encode(read_dataset(Path(args.dataset)))
    cfg = load_model_config(model_dir)
    chunks = windows(token_ids, min(args.max_length, cfg.max_position_embeddings))
    if not chunks:
        raise ValueError(f"dataset {args.dataset} has fewer than 2 tokens")
    base = evaluate_level(model_dir, "none", chunks, args.dtype, args.device)
    result: dict[str, Any] = {
        "model": str(model_dir),
        "dataset": str(args.dataset),
        "num_tokens": base["num_tokens"],
        "dtype": args.dtype,
        "baseline": {"quantization": "none", **base},
        "levels": {},
    }
    for level in levels:
        measured = (
            base
            if level == "none"
            else evaluate_level(model_dir, level, chunks, args.dtype, args.device)
        )
        result["levels"][level] = {
            "perplexity": measured["perplexity"],
            "relative_loss": relative_loss(measured["perplexity"], base["perplexity"]),
            "weight_bytes": measured["weight_bytes"],
        }
    return result


def format_table(result: dict[str, Any]) -> str:
    base = result["baseline"]
    lines = [
        f"model {result['model']}  dataset {result['dataset']}  tokens {result['num_tokens']}",
        f"{'level':<6} {'perplexity':>11} {'rel. loss':>10} {'weight MiB':>11}",
        f"{'none':<6} {base['perplexity']:>11.3f} {'-':>10} {base['weight_bytes'] / 2**20:>11.2f}",
    ]
    for level, row in result["levels"].items():
        lines.append(
            f"{level:<6} {row['perplexity']:>11.3f} {row['relative_loss']:>+9.2%} "
            f"{row['weight_bytes'] / 2**20:>11.2f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvpilot-runtime eval", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", required=True, help="HF-format model directory")
    parser.add_argument("--dataset", required=True, help="text file, or .jsonl with a text field")
    parser.add_argument("--quantization", default="bf16,int8,int4", help="comma-separated levels")
    parser.add_argument("--max-length", type=int, default=512, help="tokens per window")
    parser.add_argument("--dtype", default="float32", help="compute dtype for every level")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"kvpilot-runtime eval: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_table(result))
    return 0
