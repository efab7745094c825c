"""KV-cache dtype: capacity and quality of fp8 (and bf16/fp16) KV against the model dtype.

    .venv/bin/python -m bench.engine_kv_dtype [--kv-mib 16] [--num-requests 48]

Capacity: KV blocks at one budget per (model dtype, KV dtype), and the peak number of sequences
the engine runs together on a mixed workload queued at once, auto vs fp8. Quality on the
tiny-llama eval split (512-token windows, every token after a window's first reading its context
back from the paged cache, as a decode does): perplexity per KV dtype, greedy tokens of 32
prompts against the model-dtype cache, and the fp8 scale study behind the fixed scale of 1.0
(layers/kv_cache.py): K/V reconstruction error, KL to the model-dtype-KV next-token
distribution, top-1 agreement and perplexity for scale 1.0, a calibrated amax/448 (amax from a
512-token warm-up on other text) and a too-small 0.01.
"""

from __future__ import annotations

import argparse
import math
import random
import sys

import torch
import torch.nn.functional as F  # noqa: N812 - the torch convention

from bench.engine_common import (
    MODEL,
    clock,
    corpus_ids,
    greedy,
    make_engine,
    mixed_workload,
    setup_threads,
    threads_note,
)
from bench.report import markdown_table, write_section
from kvpilot.contract import memory
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sizing import model_facts
from kvpilot.runtime.evaluate import (
    cached_context_meta,
    read_dataset,
    relative_loss,
    window_logits,
    windows,
)
from kvpilot.runtime.layers import kv_cache
from kvpilot.runtime.models.llama import LlamaModel
from kvpilot.runtime.models.tokenizer_files import Tokenizer

MAX_MODEL_LEN = 2048
CAPACITY_CASES = [("auto", "auto"), ("auto", "bf16"), ("auto", "fp8"), ("bfloat16", "auto")]
CAPACITY_CASES += [("bfloat16", "fp8")]
QUALITY_DTYPES = ["bf16", "fp16", "fp8"]
Scales = list[tuple[float, float]]


def capacity_rows(budget: int) -> list[list[object]]:
    rows: list[list[object]] = []
    baseline: dict[str, int] = {}
    for dtype, kv_name in CAPACITY_CASES:
        engine = make_engine(
            dtype=dtype, kv_cache_dtype=kv_name, kv_cache_memory=budget, max_model_len=MAX_MODEL_LEN
        )
        blocks = engine.stats().num_total_blocks
        baseline.setdefault(dtype, blocks)  # each model dtype's first case is its auto
        per_token = memory.kv_bytes_per_token(
            model_facts(engine.model_config), engine.kv_dtype.itemsize
        )
        model_dtype = str(engine.runner.model.dtype).removeprefix("torch.")
        stored = str(engine.kv_dtype).removeprefix("torch.")
        ratio = f"{blocks / baseline[dtype]:.2f}x"
        rows.append([model_dtype, f"{kv_name} ({stored})", per_token, blocks, ratio])
    return rows


def peak_running(kv_name: str, budget: int, num_requests: int) -> tuple[int, int]:
    """(peak sequences running together, preemptions) for the mixed workload at one budget."""
    engine = make_engine(
        kv_cache_dtype=kv_name,
        kv_cache_memory=budget,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=1024,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
    )
    for index, req in enumerate(mixed_workload(num_requests, (32, 512), (16, 64), seed=1)):
        engine.add_request(req.prompt, greedy(req.num_output_tokens), str(index))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.stats().num_running)
    return peak, engine.stats().num_preemptions


def eval_prompts(ids: list[int]) -> list[list[int]]:
    """32 prompts of 4 to 200 tokens cut from the eval split (as tests/runtime do)."""
    rng = random.Random(7)
    prompts = []
    for _ in range(32):
        length = rng.choice([4, 9, 17, 33, 64, 120, 200])
        start = rng.randrange(1, len(ids) - 2 * length)
        prompts.append([ids[0], *ids[start : start + length]])
    return prompts


def greedy_run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """Greedy 24 tokens per prompt, all together; (tokens per prompt, seconds)."""
    params = greedy(24)
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, params, str(index))
    tokens: list[list[int]] = [[] for _ in prompts]
    start = clock()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[int(out.request_id)] += out.new_token_ids
    return tokens, clock() - start


def agreement(got: list[list[int]], reference: list[list[int]]) -> tuple[float, int]:
    """(share of positions with the same token, prompts identical throughout); ignore_eos keeps
    every output 24 tokens long."""
    pairs = [(a, b) for g, r in zip(got, reference, strict=True) for a, b in zip(g, r, strict=True)]
    same_prompts = sum(g == r for g, r in zip(got, reference, strict=True))
    return sum(a == b for a, b in pairs) / len(pairs), same_prompts


def engine_for_eval(kv_name: str) -> Engine:
    return make_engine(kv_cache_dtype=kv_name, max_model_len=512, kv_cache_memory=16 * 2**20)


@torch.inference_mode()
def layer_kv(model: LlamaModel, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer the keys and values [T, H_kv, D] of `ids`, in the model dtype."""
    cfg, device, num_tokens = model.cfg, model.cos.device, len(ids)
    shape = (-(-num_tokens // memory.BLOCK_SIZE), memory.BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    caches = kv_cache.allocate(cfg.num_layers, shape, model.dtype, device)
    meta = cached_context_meta(num_tokens, cfg.num_heads // cfg.num_kv_heads, model.dtype, device)
    positions = torch.arange(num_tokens, device=device)
    model.forward(torch.tensor(ids, device=device), positions, caches, meta)
    return [
        (k.data.flatten(0, 1)[:num_tokens], v.data.flatten(0, 1)[:num_tokens]) for k, v in caches
    ]


def reconstruction_error(
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]], scales: Scales
) -> float:
    """Relative RMS error of K and V through fp8 at `scales`, over every window and layer."""
    fp8, error, norm = torch.float8_e4m3fn, 0.0, 0.0
    for layers in kv:
        for (k, v), (k_scale, v_scale) in zip(layers, scales, strict=True):
            for x, scale in ((k, k_scale), (v, v_scale)):
                back = kv_cache.dequantize(kv_cache.quantize(x, fp8, scale), x.dtype, scale)
                error += float((back - x).float().pow(2).sum())
                norm += float(x.float().pow(2).sum())
    return math.sqrt(error / norm)


def perplexity(model: LlamaModel, chunks: list[list[int]], kv_dtype: torch.dtype) -> float:
    device, nll = model.cos.device, 0.0
    for ids in chunks:
        logits = window_logits(model, ids, device, kv_dtype)  # [T - 1, vocab]
        nll += float(F.cross_entropy(logits, torch.tensor(ids[1:], device=device), reduction="sum"))
    return math.exp(nll / sum(len(ids) - 1 for ids in chunks))


def logit_study(
    model: LlamaModel, chunks: list[list[int]], kv_dtype: torch.dtype, scales: Scales | None
) -> tuple[float, float, float]:
    """(perplexity, mean KL to the model-dtype KV, top-1 agreement) over the windows."""
    device = model.cos.device
    nll = kl = agree = 0.0
    num_targets = 0
    for ids in chunks:
        reference = window_logits(model, ids, device).log_softmax(-1)  # [T - 1, vocab]
        logprobs = window_logits(model, ids, device, kv_dtype, scales).log_softmax(-1)
        targets = torch.tensor(ids[1:], device=device)
        nll += float(F.nll_loss(logprobs, targets, reduction="sum"))
        kl += float(F.kl_div(logprobs, reference, log_target=True, reduction="sum"))
        agree += float((logprobs.argmax(-1) == reference.argmax(-1)).sum())
        num_targets += len(ids) - 1
    return math.exp(nll / num_targets), kl / num_targets, agree / num_targets


def scale_options(model: LlamaModel) -> dict[str, Scales]:
    warm_up = layer_kv(model, corpus_ids()[:512])  # other text than the eval split
    calibrated = [
        (kv_cache.fp8_scale(float(k.abs().max())), kv_cache.fp8_scale(float(v.abs().max())))
        for k, v in warm_up
    ]
    num_layers = model.cfg.num_layers
    return {
        "fixed 1.0 (the runtime's)": [(kv_cache.DEFAULT_FP8_SCALE,) * 2] * num_layers,
        "calibrated amax/448": calibrated,
        "fixed 0.01 (too small: clips)": [(0.01, 0.01)] * num_layers,
    }


def scale_rows(model: LlamaModel, chunks: list[list[int]]) -> list[list[object]]:
    kv = [layer_kv(model, ids) for ids in chunks]
    base = perplexity(model, chunks, model.dtype)
    rows: list[list[object]] = []
    for name, scales in scale_options(model).items():
        ppl, kl, top1 = logit_study(model, chunks, torch.float8_e4m3fn, scales)
        rmse = reconstruction_error(kv, scales)
        rows.append(
            [name, f"{rmse:.2%}", f"{kl:.1e}", f"{top1:.2%}", f"{relative_loss(ppl, base):+.3%}"]
        )
    return rows


def quality_rows(
    chunks: list[list[int]], prompts: list[list[int]]
) -> tuple[list[list[object]], LlamaModel]:
    """Perplexity, greedy agreement and decode time per KV dtype, against auto."""
    auto = engine_for_eval("auto")
    model = auto.runner.model
    base = perplexity(model, chunks, model.dtype)
    reference, base_time = greedy_run(auto, prompts)
    auto_name = str(model.dtype).removeprefix("torch.")
    rows: list[list[object]] = [[f"auto ({auto_name})", f"{base:.3f}", "-", "-", "1.00x"]]
    for kv_name in QUALITY_DTYPES:
        engine = engine_for_eval(kv_name)
        ppl = perplexity(model, chunks, engine.kv_dtype)
        got, seconds = greedy_run(engine, prompts)
        same, whole = agreement(got, reference)
        rows.append(
            [
                kv_name,
                f"{ppl:.3f}",
                f"{relative_loss(ppl, base):+.3%}",
                f"{same:.1%} ({whole}/{len(prompts)} prompts whole)",
                f"{seconds / base_time:.2f}x",
            ]
        )
    return rows, model


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-mib", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=48)
    args = parser.parse_args(argv)
    setup_threads()
    budget = args.kv_mib * 2**20
    ids = Tokenizer(MODEL).encode(read_dataset(MODEL / "eval.txt"))
    chunks = windows(ids, 512)
    quality, model = quality_rows(chunks, eval_prompts(ids))
    peaks = {name: peak_running(name, budget // 4, args.num_requests) for name in ("auto", "fp8")}
    body = "\n\n".join(
        [
            f"{threads_note()} Model models/tiny-llama; KV budget {args.kv_mib} MiB.",
            "KV blocks of 16 tokens at the same budget (the auto KV dtype is the compute dtype: "
            "float32 on a CPU without bf16 units, else the checkpoint's bf16, where fp8 doubles "
            "the blocks):",
            markdown_table(
                ["model dtype", "KV dtype", "KV bytes/token", "blocks", "vs auto"],
                capacity_rows(budget),
            ),
            f"Peak sequences running together at {args.kv_mib / 4:g} MiB, {args.num_requests} "
            "requests queued at once (prompts 32-512, outputs 16-64): "
            + ", ".join(f"{name} {peak} ({pre} preemptions)" for name, (peak, pre) in peaks.items())
            + f"; fp8 / auto {peaks['fp8'][0] / max(peaks['auto'][0], 1):.2f}x.",
            f"Quality on models/tiny-llama/eval.txt ({sum(len(c) - 1 for c in chunks)} "
            "predicted tokens, 512-token windows); greedy: 32 prompts x 24 tokens against auto; "
            "decode time: the greedy run's compute time against auto's (one short run, so "
            "+-20% is noise on a shared CPU):",
            markdown_table(
                ["KV dtype", "perplexity", "vs auto", "greedy tokens as auto", "decode time"],
                quality,
            ),
            "fp8 scale (why the runtime fixes it at 1.0; tiny-llama's |K|, |V| <= 10):",
            markdown_table(
                ["fp8 scale", "K/V rel. RMS error", "KL to auto KV", "top-1 as auto", "perplexity"],
                scale_rows(model, chunks),
            ),
        ]
    )
    command = " ".join(["python -m bench.engine_kv_dtype", *argv])
    write_section("engine_kv_dtype", "Engine: KV-cache dtype (fp8 KV)", command, body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
