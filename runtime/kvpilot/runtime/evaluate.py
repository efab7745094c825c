"""`kvpilot-runtime eval`: quality per quantisation level and the relative loss vs unquantised.

    kvpilot-runtime eval --model models/tiny-llama --dataset models/tiny-llama/eval.txt \
        --quantization bf16,int8,int4 [--metric perplexity|agreement|exact-match] \
        [--kv-cache-dtype fp8] [--checkpoint NAME=PATH ...] [--json] [--summary-file PATH]

Metrics, all from one teacher-forced pass per level over the same tokens:
- perplexity (text): relative loss = ppl(level) / ppl(none) - 1.
- agreement (text): the share of positions where the level's greedy next token is the
  baseline's; relative loss = 1 - agreement.
- exact-match (.jsonl of {"prompt", "answer"}): the share of pairs whose answer greedy decoding
  reproduces token for token (every answer token is the argmax given the prompt and the answer
  before it, which is exactly what a greedy decode checks); relative loss = 1 - em / em(none).

The baseline is the checkpoint's weights unquantised (`none`; `--baseline LEVEL` makes it that
level instead, for a model whose unquantised weights fit no GPU at hand) with the KV cache in
the compute dtype; every level runs in the same compute dtype, so the difference is the weight
format alone, or with `--kv-cache-dtype fp8` (levels may include `none`) the weight format and the
KV storage. The relative loss of the chosen metric is the number the operator gates
`quantization.maxQualityLoss` on. Every token but a window's first reads its context back from
the paged KV cache, as a decode does.

`--checkpoint NAME=PATH` also scores another published checkpoint of the model (a pre-quantised
variant) against the same baseline, in the same compute dtype (eval_checkpoints.py): its row,
under `checkpoints`, compares with the levels'.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the torch convention

from kvpilot.contract.dataset_source import parse_dataset_uri
from kvpilot.contract.engine_config import (
    INT8_KERNEL_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
)
from kvpilot.contract.fetch import FetchError, fetch_dataset
from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine import machine_files
from kvpilot.runtime.engine.model_runner import load_model
from kvpilot.runtime.engine.sizing import resolve_device
from kvpilot.runtime.eval_checkpoints import (
    candidate_config,
    checkpoint_format,
    checkpoint_level,
    parse_candidates,
)
from kvpilot.runtime.eval_report import format_table, summary
from kvpilot.runtime.layers import kv_cache
from kvpilot.runtime.layers.attention import AttentionMetadata, PrefillSpan, chunk_mask
from kvpilot.runtime.layers.kv_cache import resolve_kv_cache_dtype
from kvpilot.runtime.layers.quant import resolve_int8_kernel
from kvpilot.runtime.models.llama import LlamaModel
from kvpilot.runtime.models.loader import ModelConfig, load_model_config, resolve_dtype
from kvpilot.runtime.models.tokenizer_files import Tokenizer

METRICS = ("perplexity", "agreement", "exact-match")


@dataclass(frozen=True)
class Sample:
    """Token ids whose targets ids[scored_from:] are scored, each given everything before it."""

    ids: list[int]
    scored_from: int = 1


def read_dataset(path: Path) -> str:
    """Plain text, or JSON lines with a `text` field per line."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    if path.suffix == ".jsonl":
        lines = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
        return "\n\n".join(lines)
    return path.read_text()


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """JSON lines with `prompt` and `answer` fields (the exact-match metric's dataset)."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not row.get("prompt") or not row.get("answer"):
            raise ValueError(f"{path}:{number}: exact-match needs a non-empty prompt and answer")
        pairs.append((str(row["prompt"]), str(row["answer"])))
    return pairs


def dataset_digest(path: Path) -> str:
    """What the operator caches measurements by: the same bytes measure the same."""
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def windows(token_ids: list[int], max_length: int) -> list[list[int]]:
    """Non-overlapping windows; a trailing window of one token has nothing to predict."""
    chunks = [token_ids[i : i + max_length] for i in range(0, len(token_ids), max_length)]
    return [c for c in chunks if len(c) >= 2]


def relative_loss(value: float, baseline: float, metric: str = "perplexity") -> float:
    """How much worse `value` is than the baseline's, as a fraction (0.01 = 1% worse)."""
    if metric == "perplexity":
        return value / baseline - 1.0
    if metric == "agreement":
        return 1.0 - value  # the baseline agrees with itself everywhere
    if baseline <= 0:
        raise ValueError("the baseline reproduces none of the answers: exact-match cannot measure")
    return 1.0 - value / baseline


def samples_for(metric: str, dataset: Path, tokenizer: Tokenizer, max_length: int) -> list[Sample]:
    if metric == "exact-match":
        out = []
        for prompt, answer in read_pairs(dataset):
            prompt_ids = tokenizer.encode(prompt)
            ids = prompt_ids + tokenizer.encode(answer, add_special_tokens=False)
            if len(ids) > max_length:
                raise ValueError(f"a prompt and answer of {len(ids)} tokens exceed {max_length}")
            out.append(Sample(ids, len(prompt_ids)))
        return out
    token_ids = tokenizer.encode(read_dataset(dataset))
    return [Sample(chunk) for chunk in windows(token_ids, max_length)]


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


@dataclass
class Scores:
    """One level's pass: summed NLL of the scored targets, their count, its greedy tokens."""

    nll: float
    num_targets: int
    greedy: list[torch.Tensor]
    exact: int  # samples whose every scored target is the greedy token
    weight_bytes: int = 0


def score(
    model: LlamaModel, samples: list[Sample], device: torch.device, kv_dtype: torch.dtype | None
) -> Scores:
    nll, num_targets, greedy, exact = 0.0, 0, [], 0
    for sample in samples:
        logits = window_logits(model, sample.ids, device, kv_dtype)[sample.scored_from - 1 :]
        targets = torch.tensor(sample.ids[sample.scored_from :], device=device)
        nll += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
        num_targets += len(targets)
        tokens = logits.argmax(dim=-1)
        greedy.append(tokens.cpu())
        exact += int(bool((tokens == targets).all()))
    return Scores(nll, num_targets, greedy, exact)


def perplexity(scores: Scores) -> float:
    return math.exp(scores.nll / scores.num_targets)


def metric_value(metric: str, scores: Scores, baseline: Scores, num_samples: int) -> float:
    if metric == "perplexity":
        return perplexity(scores)
    if metric == "agreement":
        same = sum(int((a == b).sum()) for a, b in zip(scores.greedy, baseline.greedy, strict=True))
        return same / scores.num_targets
    return scores.exact / num_samples


def evaluate_level(
    model_dir: Path,
    quantization: str,
    samples: list[Sample],
    dtype_name: str,
    device_name: str,
    kv_cache_dtype: str = "auto",
    int8_kernel: str = "auto",
) -> Scores:
    """The level's scores, with the kernels `serve` would run on this machine (the eval Job
    runs on the node type it measures for), `--int8-kernel` included."""
    settings = (dtype_name, device_name, kv_cache_dtype, int8_kernel)
    return evaluate_checkpoint(
        model_dir, load_model_config(model_dir), quantization, samples, settings
    )


def evaluate_checkpoint(
    model_dir: Path,
    cfg: ModelConfig,
    quantization: str,
    samples: list[Sample],
    settings: tuple[str, str, str, str],
    dtype_of: ModelConfig | None = None,
) -> Scores:
    """`settings`: dtype, device, KV-cache dtype and int8 kernel names. `dtype_of`: the config
    whose torch_dtype `--dtype auto` resolves from (the baseline's, for a candidate checkpoint:
    every row in the same compute dtype)."""
    dtype_name, device_name, kv_cache_dtype, int8_kernel = settings
    device = resolve_device(device_name)
    dtype = resolve_dtype(dtype_name, (dtype_of or cfg).torch_dtype, device)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, device)
    kernel = resolve_int8_kernel(int8_kernel, device, machine_files.cpu_supports_int8_dot())
    model = load_model(model_dir, cfg, quantization, dtype, device, int8_kernel=kernel)
    scores = score(model, samples, device, kv_dtype)
    scores.weight_bytes = model.weight_bytes()
    return scores


def level_row(metric: str, scores: Scores, base: Scores, num_samples: int) -> dict[str, Any]:
    value = metric_value(metric, scores, base, num_samples)
    return {
        "value": value,
        "relative_loss": relative_loss(
            value, metric_value(metric, base, base, num_samples), metric
        ),
        "perplexity": perplexity(scores),
        "agreement": metric_value("agreement", scores, base, num_samples),
        "weight_bytes": scores.weight_bytes,
    }


@contextmanager
def local_dataset(uri: str) -> Iterator[Path]:
    """The eval set as a local file: hf:// and s3:// fetched into a temporary directory (gone
    afterwards), a path or file:// as it is. The digest is of these bytes, wherever they came
    from, so the operator caches by content."""
    source = parse_dataset_uri(uri)
    if source.scheme == "pvc":
        raise ValueError(f"{uri}: a pvc:// dataset is mounted by the eval Job: pass its path")
    if not source.is_fetched:
        yield Path(source.location)
        return
    with tempfile.TemporaryDirectory(prefix="kvpilot-eval-") as scratch:
        yield fetch_dataset(source, Path(scratch))


def run(args: argparse.Namespace) -> dict[str, Any]:
    with local_dataset(args.dataset) as dataset:
        return measure(args, dataset)


def measure(args: argparse.Namespace, dataset: Path) -> dict[str, Any]:
    model_dir = Path(args.model)
    levels = [q.strip() for q in args.quantization.split(",") if q.strip()]
    unknown = [q for q in levels if q not in QUANTIZATION_CHOICES]
    if unknown:
        raise ValueError(f"unknown quantization {unknown}; expected among {QUANTIZATION_CHOICES}")
    cfg = load_model_config(model_dir)
    # Checked before the baseline's minutes are spent: a wrong candidate fails at once.
    candidates = [(c, candidate_config(c, cfg)) for c in parse_candidates(args.checkpoint, levels)]
    max_length = min(args.max_length, cfg.max_position_embeddings)
    samples = samples_for(args.metric, dataset, Tokenizer(model_dir), max_length)
    if not samples:
        raise ValueError(f"dataset {args.dataset} has nothing to score (fewer than 2 tokens?)")
    base = evaluate_level(
        model_dir, args.baseline, samples, args.dtype, args.device, int8_kernel=args.int8_kernel
    )
    result = result_header(args, dataset, len(samples), base)
    kv_name = args.kv_cache_dtype
    settings = (args.dtype, args.device, kv_name, args.int8_kernel)
    for level in levels:
        measured = (
            base
            if level == args.baseline and kv_name == "auto"
            else evaluate_checkpoint(model_dir, cfg, level, samples, settings)
        )
        result["levels"][level] = level_row(args.metric, measured, base, len(samples))
    for candidate, candidate_cfg in candidates:
        measured = evaluate_checkpoint(
            candidate.path, candidate_cfg, "none", samples, settings, dtype_of=cfg
        )
        result["checkpoints"][candidate.name] = {
            "path": str(candidate.path),
            "level": checkpoint_level(candidate_cfg),
            "format": checkpoint_format(candidate_cfg),
            **level_row(args.metric, measured, base, len(samples)),
        }
    return result


def result_header(
    args: argparse.Namespace, dataset: Path, num_samples: int, base: Scores
) -> dict[str, Any]:
    return {
        "model": args.model,
        "dataset": args.dataset,
        "dataset_digest": dataset_digest(dataset),
        "metric": args.metric,
        "num_samples": num_samples,
        "num_tokens": base.num_targets,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "int8_kernel": args.int8_kernel,
        "baseline": {
            "quantization": args.baseline,
            "kv_cache_dtype": "auto",
            **level_row(args.metric, base, base, num_samples),
        },
        "levels": {},
        "checkpoints": {},
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvpilot-runtime eval", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", required=True, help="HF-format model directory")
    parser.add_argument(
        "--dataset",
        required=True,
        help="text file or .jsonl with a text field; for exact-match .jsonl of prompt and answer;"
        " a path, file://, hf://ORG/NAME[@REV]/PATH (hf://datasets/... for a dataset repo) or"
        " s3://BUCKET/KEY (fetched with HF_ENDPOINT, HF_TOKEN, AWS_* as `fetch` does)",
    )
    parser.add_argument("--metric", default="perplexity", choices=METRICS)
    parser.add_argument("--quantization", default="bf16,int8,int4", help="comma-separated levels")
    parser.add_argument(
        "--baseline",
        default="none",
        choices=QUANTIZATION_CHOICES,
        help="the reference the loss is relative to: the unquantised weights (none), or where"
        " they fit no GPU the largest level that does (the operator's reference level)",
    )
    parser.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also score this checkpoint of the same model (e.g. an AWQ or compressed-tensors"
        " variant, loaded as serve loads it) against the same baseline; repeatable",
    )
    parser.add_argument("--max-length", type=int, default=512, help="tokens per window")
    parser.add_argument("--dtype", default="float32", help="compute dtype for every level")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPE_CHOICES,
        help="KV-cache storage for every level (the baseline keeps auto)",
    )
    parser.add_argument(
        "--int8-kernel",
        default="auto",
        choices=INT8_KERNEL_CHOICES,
        help="the int8 level's matmul, as `serve --int8-kernel` (auto: what serve picks here)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--summary-file",
        type=Path,
        help="also write a short JSON summary here (a Job's /dev/termination-log)",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except (ValueError, FileNotFoundError, FetchError) as error:
        print(f"kvpilot-runtime eval: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_table(result))
    if args.summary_file:
        args.summary_file.write_text(json.dumps(summary(result), separators=(",", ":")))
    return 0
