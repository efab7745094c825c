"""`kvpilot-runtime eval`: perplexity per quantisation level and the relative loss vs unquantised.

    kvpilot-runtime eval --model models/tiny-llama --dataset models/tiny-llama/eval.txt \
        --quantization bf16,int8,int4 [--kv-cache-dtype fp8] [--json]

The baseline is the checkpoint's weights unquantised (`none`) with the KV cache in the compute
dtype; every level runs in the same compute dtype, so the difference is the weight format alone,
or with `--kv-cache-dtype fp8` (levels may include `none`) the weight format and the KV storage.
Relative loss = ppl(level) / ppl(none) - 1, the number the operator gates
`quantization.maxQualityLoss` on. Every token but a window's first reads its context back from
the paged KV cache, as a decode does.
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

from kvpilot.runtime.config import KV_CACHE_DTYPE_CHOICES, QUANTIZATION_CHOICES
from kvpilot.runtime.engine import resolve_device
from kvpilot.runtime.layers import kv_cache
from kvpilot.runtime.layers.attention import AttentionMetadata, PrefillSpan, chunk_mask
from kvpilot.runtime.layers.kv_cache import resolve_kv_cache_dtype
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


def cached_context_meta(
    num_tokens: int, num_groups: int, dtype: torch.dtype, device: torch.device
) -> AttentionMetadata:
    """The first token as a chunk of its own, then the rest as a chunk over it: every later token
    reads its whole context (its own key and value included) back from the paged cache, exactly
    as a decode does, so the KV-cache dtype counts in the perplexity. (A single first chunk would
    attend to its fresh keys and values and never read the cache.)"""
    block_table = torch.arange(-(-num_tokens // BLOCK_SIZE), device=device)
    rest = num_tokens - 1
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        prefills=[
            PrefillSpan(0, 1, 0, block_table),
            PrefillSpan(1, rest, 1, block_table, chunk_mask(rest, 1, num_groups, dtype, device)),
        ],
    )


@torch.inference_mode()
def window_logits(
    model: LlamaModel,
    ids: list[int],
    device: torch.device,
    kv_dtype: torch.dtype | None = None,
    scales: list[tuple[float, float]] | None = None,
) -> torch.Tensor:
    """Logits [T - 1, vocab] predicting ids[1:], with the KV cache stored in `kv_dtype` (default:
    the model dtype) at per-layer (k, v) `scales` (default: the runtime's)."""
    num_tokens, cfg = len(ids), model.cfg
    shape = (-(-num_tokens // BLOCK_SIZE), BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    caches = kv_cache.allocate(cfg.num_layers, shape, kv_dtype or model.dtype, device, scales)
    meta = cached_context_meta(num_tokens, cfg.num_heads // cfg.num_kv_heads, model.dtype, device)
    positions = torch.arange(num_tokens, device=device)
    hidden = model.forward(torch.tensor(ids, device=device), positions, caches, meta)
    return model.compute_logits(hidden[:-1])  # [T - 1, vocab]


def window_nll(
    model: LlamaModel, ids: list[int], device: torch.device, kv_dtype: torch.dtype | None = None
) -> float:
    """Summed negative log-likelihood of ids[1:] given the tokens before each."""
    logits = window_logits(model, ids, device, kv_dtype)  # [T - 1, vocab]
    targets = torch.tensor(ids[1:], device=device)
    return float(F.cross_entropy(logits, targets, reduction="sum"))


def evaluate_level(
    model_dir: Path,
    quantization: str,
    chunks: list[list[int]],
    dtype_name: str,
    device_name: str,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    cfg = load_model_config(model_dir)
    device = resolve_device(device_name)
    dtype = resolve_dtype(dtype_name, cfg.torch_dtype, device)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, device)
    model = load_model(model_dir, cfg, quantization, dtype, device)
    nll = sum(window_nll(model, chunk, device, kv_dtype) for chunk in chunks)
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
        "kv_cache_dtype": args.kv_cache_dtype,
        "baseline": {"quantization": "none", "kv_cache_dtype": "auto", **base},
        "levels": {},
    }
    kv_name = args.kv_cache_dtype
    for level in levels:
        measured = (
            base
            if level == "none" and kv_name == "auto"
            else evaluate_level(model_dir, level, chunks, args.dtype, args.device, kv_name)
        )
        result["levels"][level] = {
            "perplexity": measured["perplexity"],
            "relative_loss": relative_loss(measured["perplexity"], base["perplexity"]),
            "weight_bytes": measured["weight_bytes"],
        }
    return result


def format_table(result: dict[str, Any]) -> str:
    base, kv_name = result["baseline"], result["kv_cache_dtype"]
    suffix = "" if kv_name == "auto" else f"+{kv_name}"  # e.g. none+fp8: that level, fp8 KV
    lines = [
        f"model {result['model']}  dataset {result['dataset']}  tokens {result['num_tokens']}  "
        f"KV cache {kv_name} (baseline: none, KV auto)",
        f"{'level':<9} {'perplexity':>11} {'rel. loss':>10} {'weight MiB':>11}",
        f"{'none':<9} {base['perplexity']:>11.3f} {'-':>10} {base['weight_bytes'] / 2**20:>11.2f}",
    ]
    for level, row in result["levels"].items():
        lines.append(
            f"{level + suffix:<9} {row['perplexity']:>11.3f} {row['relative_loss']:>+9.2%} "
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
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPE_CHOICES,
        help="KV-cache storage for every level (the baseline keeps auto)",
    )
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
