"""Device checks for a lent GPU (bench/gpu_check.sh runs this): parity with transformers on the
same device per quantisation, fp8 KV, tensor parallel 2 when there are two GPUs.

    python -m bench.gpu.check --device cuda --out DIR     (--device cpu: the dry run)

Each check prints one PASS/FAIL/SKIP line with its figures and the threshold it was held to, and
everything lands in DIR/gpu_check.json and DIR/gpu_check.md. Exit 1 when a check fails.

- parity: teacher-forced logits over 4 prompts (every token after the first reading the paged
  cache, as a decode does) against transformers' forward, and greedy tokens of 32 prompts x 24
  against transformers' generate(), for quantisation none/bf16/int8/int4 in float32 and for
  none in bfloat16 (the GPU default), transformers in the same compute dtype. int8/int4 differ
  from the unquantised reference by design; their thresholds sit below the CPU measurement.
- fp8 KV: pool blocks against bf16 KV at one budget, greedy against the model-dtype cache,
  perplexity on 4 eval windows (bounds of tests/runtime/test_rt_kv_dtype.py).
- tensor parallel 2 (two or more GPUs): greedy tokens equal to one GPU's.
- pre-quantised checkpoints (GPTQ act-order, AWQ, compressed-tensors int4 and fp8, written here
  by bench.gpu.prequant_refs into .gpu-refs/ and carried): served as stored on the GPU against
  the same checkpoint on CPU, logits and greedy tokens (PREQUANT_BOUNDS); SKIP without them.
- CUDA graphs (engine/cuda_graphs.py) on the SDPA path, float32 and bfloat16: greedy tokens of
  the graph-replaying engine against `--enforce-eager`'s (32 prompts at once, so the batch shrinks
  through many buckets as prompts stop), and the capture's time and memory.
- FlashInfer (`--flashinfer`, a step of its own; where flashinfer-python imports, carried as a
  wheel, see bench/gpu_check.sh), on
  the compute-bound random Llama (head size 64; tiny-llama's 32 has no FlashInfer kernel) in
  bfloat16: one planned step's attention against the SDPA path's (decodes, proposals, chunks over
  cached KV; bf16 and fp8 KV), greedy tokens against the SDPA engine's, and output tok/s with
  and without it; with CUDA graphs (FlashInfer's graph decode wrapper) greedy tokens and tok/s
  against the same engine under --enforce-eager.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from itertools import zip_longest
from pathlib import Path
from typing import Any

import torch

from bench.engine_common import COMPUTE_BOUND_SHAPE, MODEL, compute_bound_llama
from bench.engine_kv_dtype import eval_prompts, perplexity
from bench.reference.attention_batches import MIXED_STEP, fp8_exact, mixed_batch
from bench.report import command_line, write_section
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.cuda_graphs import CudaGraphRunner
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.evaluate import read_dataset, relative_loss, window_logits, windows
from kvpilot.runtime.layers import flashinfer_attention
from kvpilot.runtime.layers.attention import paged_attention
from kvpilot.runtime.models.tokenizer_files import Tokenizer

MAX_NEW_TOKENS = 24
TITLE = "GPU check: the engine against transformers on the same GPU"
DOC_TEXT = (
    "bench/gpu_check.sh on a lent GPU machine (no network; llguidance carried as a wheel). "
    "Teacher-forced logits and greedy tokens against transformers per quantisation and compute "
    "dtype, fp8 KV against the model-dtype cache; each bound is in bench/gpu/check.py.\n\n"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (quantisation, compute dtype) -> (max |logit diff|, min top-1 agreement, min greedy positions).
# Measured in the CPU dry run: none 3.8e-6 / 100% / 100%; bf16 the same (the checkpoint is stored
# in bf16); int8 0.069 / 99.4% / 96.1%; int4 1.02 / 92.4% / 48.4%; none in bfloat16 0.0 / 100% /
# 98.0%. GPU kernels round differently, so the bounds leave room without letting a broken path by.
PARITY_BOUNDS = {
    ("none", "float32"): (1e-3, 0.99, 0.97),
    ("bf16", "float32"): (0.1, 0.98, 0.85),
    ("int8", "float32"): (0.4, 0.96, 0.75),
    ("int4", "float32"): (3.0, 0.85, 0.4),
    ("none", "bfloat16"): (0.5, 0.95, 0.7),
}


@dataclass
class Result:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str
    figures: dict[str, Any]


def engine(device: str, model: Path = MODEL, **kwargs: Any) -> Engine:
    kwargs.setdefault("max_model_len", 512)
    kwargs.setdefault("kv_cache_memory", 16 * 2**20)
    return Engine(EngineConfig(model=str(model), device=device, **kwargs))


@cache
def eval_ids() -> list[int]:
    return Tokenizer(MODEL).encode(read_dataset(MODEL / "eval.txt"))


@cache
def hf_model(device: str, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(MODEL, dtype=DTYPES[dtype])
    return model.to(device).eval()


@cache
def hf_greedy(device: str, dtype: str) -> tuple[tuple[int, ...], ...]:
    """transformers' generate() per prompt, stopping at EOS as the engine does."""
    model, outputs = hf_model(device, dtype), []
    with torch.no_grad():
        for prompt in eval_prompts(eval_ids()):
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            outputs.append(tuple(out[0, len(prompt) :].tolist()))
    return tuple(outputs)


def run_greedy(eng: Engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0)
    prompts = eval_prompts(eval_ids())
    for index, prompt in enumerate(prompts):
        eng.add_request(prompt, params, str(index))
    tokens: list[list[int]] = [[] for _ in prompts]
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[int(out.request_id)] += out.new_token_ids
    return tokens


def agreement(got: list[list[int]], reference: list[list[int]]) -> tuple[float, int]:
    """(share of positions alike, a stop counting as a different token; prompts alike)."""
    pairs = [p for g, r in zip(got, reference, strict=True) for p in zip_longest(g, r)]
    whole = sum(list(g) == list(r) for g, r in zip(got, reference, strict=True))
    return sum(a == b for a, b in pairs) / len(pairs), whole


def logit_parity(
    eng: Engine, reference: Callable[[list[int]], torch.Tensor]
) -> tuple[float, float]:
    """(max |our logit - the reference's|, top-1 agreement) over 4 prompts of 64-200 tokens,
    teacher-forced; `reference(prompt)` gives its logits for every position but the last."""
    ids = eval_ids()
    worst, agree, total = 0.0, 0, 0
    with torch.no_grad():
        for start, length in ((1, 64), (500, 120), (2000, 200), (4000, 160)):
            prompt = ids[start : start + length]
            ours = window_logits(eng.runner.model, prompt, eng.device).cpu()  # [T - 1, vocab]
            theirs = reference(prompt).float().cpu()
            worst = max(worst, float((ours - theirs).abs().max()))
            agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
            total += len(prompt) - 1
    return worst, agree / total


def parity_result(
    name: str, bounds: tuple[float, float, float], logits: tuple[float, float], greedy: Any
) -> Result:
    """PASS when the logits (max diff, top-1) and greedy tokens (positions alike, prompts
    whole) are inside `bounds` (max diff, min top-1, min positions)."""
    (max_diff, min_top1, min_greedy), (diff, top1), (same, whole) = bounds, logits, greedy
    is_ok = diff <= max_diff and top1 >= min_top1 and same >= min_greedy
    detail = (
        f"logits max abs diff {diff:.2e} (<= {max_diff:g}), top-1 {top1:.1%} (>= {min_top1:.0%}), "
        f"greedy {same:.1%} of positions (>= {min_greedy:.0%}), {whole}/32 prompts whole"
    )
    figures = {"max_logit_diff": diff, "top1": top1, "greedy_positions": same, "whole": whole}
    return Result(name, "PASS" if is_ok else "FAIL", detail, figures)


def check_parity(device: str, quantization: str, dtype: str) -> Result:
    eng, hf = engine(device, quantization=quantization, dtype=dtype), hf_model(device, dtype)
    logits = logit_parity(eng, lambda p: hf(torch.tensor([p], device=device)).logits[0, :-1])
    greedy = agreement(run_greedy(eng), [list(r) for r in hf_greedy(device, dtype)])
    bounds = PARITY_BOUNDS[(quantization, dtype)]
    return parity_result(f"parity {quantization}/{dtype}", bounds, logits, greedy)


# A pre-quantised checkpoint on the device against the same checkpoint on CPU (float32 compute
# on both; the int4 matmuls take bf16 activations on both, tinygemm's against the CPU kernel's):
# (max |logit diff|, min top-1 agreement, min greedy positions). The CPU dry run compares CPU
# with CPU (0, 100%, 100%); rounding in other kernels stays well inside these.
PREQUANT_BOUNDS = (0.5, 0.97, 0.8)
PREQUANT_REFS = Path(__file__).resolve().parents[2] / ".gpu-refs"  # bench.gpu.prequant_refs


def prequant_checkpoints() -> list[Path]:
    return sorted(p.parent for p in PREQUANT_REFS.glob("*/config.json"))


def check_prequant(device: str, checkpoint: Path) -> Result:
    """A GPTQ/AWQ/compressed-tensors checkpoint served as stored on `device` (CUDA: its int4
    matrices in tinygemm's layout, fp8 dequantised once) against the CPU engine on it."""
    ours, cpu = (engine(d, checkpoint, dtype="float32") for d in (device, "cpu"))
    logits = logit_parity(ours, lambda p: window_logits(cpu.runner.model, p, cpu.device))
    greedy = agreement(run_greedy(ours), run_greedy(cpu))
    return parity_result(f"pre-quantised {checkpoint.name}", PREQUANT_BOUNDS, logits, greedy)


def prequant_results(device: str) -> list[Result]:
    checkpoints = prequant_checkpoints()
    if not checkpoints:
        why = f"none in {PREQUANT_REFS}: run `python -m bench.gpu.prequant_refs` and carry it"
        return [Result("pre-quantised checkpoints", "SKIP", why, {})]
    return [timed(check_prequant, device, path) for path in checkpoints]


def check_fp8(device: str, dtype: str) -> Result:
    """fp8 KV against the model-dtype cache; bounds as in tests/runtime/test_rt_kv_dtype.py."""
    bf16_blocks = engine(device, dtype=dtype, kv_cache_dtype="bf16").stats().num_total_blocks
    auto, fp8 = engine(device, dtype=dtype), engine(device, dtype=dtype, kv_cache_dtype="fp8")
    blocks = fp8.stats().num_total_blocks
    same, whole = agreement(run_greedy(fp8), run_greedy(auto))
    chunks = windows(eval_ids(), 512)[:4]
    model = auto.runner.model
    base = perplexity(model, chunks, model.dtype)
    loss = relative_loss(perplexity(model, chunks, fp8.kv_dtype), base)
    is_ok = blocks == 2 * bf16_blocks and same >= 0.75 and whole >= 18 and abs(loss) < 1e-3
    detail = (
        f"blocks {blocks} vs bf16 KV {bf16_blocks} (2x), greedy as auto {same:.1%} (>= 75%), "
        f"{whole}/32 whole (>= 18), perplexity {loss:+.3%} (|x| < 0.1%)"
    )
    figures = {"blocks": blocks, "bf16_blocks": bf16_blocks, "greedy_positions": same}
    figures |= {"whole": whole, "perplexity_loss": loss}
    return Result(f"fp8 KV/{dtype}", "PASS" if is_ok else "FAIL", detail, figures)


def check_tensor_parallel(device: str) -> Result:
    if device != "cuda" or torch.cuda.device_count() < 2:
        return Result("tensor parallel 2", "SKIP", "needs 2+ CUDA GPUs", {})
    reference = run_greedy(engine(device, dtype="bfloat16"))
    before = gpu_used_bytes(1)
    try:
        tp = engine(device, dtype="bfloat16", tensor_parallel_size=2)
        got = run_greedy(tp)
    except Exception as error:  # report a build without TP (or a broken one), keep going
        return Result("tensor parallel 2", "FAIL", f"{type(error).__name__}: {error}", {})
    # An engine that ignored tensor_parallel_size would match TP 1 trivially: rank 1 must hold
    # its share of the weights (and a KV pool) on the second GPU.
    grown = gpu_used_bytes(1) - before
    is_sharded = grown >= tp.weight_bytes / 4
    same, whole = agreement(got, reference)
    detail = (
        f"greedy as TP 1: {same:.1%} of positions (>= 97%), {whole}/32 whole; GPU 1 took "
        f"{grown / 2**20:.0f} MiB (>= a quarter of the {tp.weight_bytes / 2**20:.1f} MiB weights)"
    )
    status = "PASS" if same >= 0.97 and is_sharded else "FAIL"
    figures = {"greedy_positions": same, "whole": whole, "gpu1_bytes": grown}
    return Result("tensor parallel 2", status, detail, figures)


# Graphs replay the eager step's kernels on padded batches: a row's arithmetic is the same except
# where a matmul's kernel choice depends on the batch (cuBLAS picks by shape), so greedy tokens
# may part at a near-tie. The goal is identical; the bound lets rounding by, not a broken path.
GRAPH_MIN_GREEDY = {"float32": 0.97, "bfloat16": 0.9}


def check_cuda_graphs(device: str, dtype: str) -> Result:
    name = f"CUDA graphs/sdpa/{dtype}"
    if device != "cuda":
        return Result(name, "SKIP", "CUDA graphs are CUDA-only: the engine decodes eagerly", {})
    eager = run_greedy(engine(device, dtype=dtype, attention_backend="sdpa", enforce_eager=True))
    eng = engine(device, dtype=dtype, attention_backend="sdpa")
    graphs = eng.runner.graphs
    if not isinstance(graphs, CudaGraphRunner):
        return Result(name, "FAIL", "no graphs were captured without --enforce-eager", {})
    same, whole = agreement(run_greedy(eng), eager)
    minimum = GRAPH_MIN_GREEDY[dtype]
    detail = (
        f"greedy as --enforce-eager {same:.1%} of positions (>= {minimum:.0%}), {whole}/32 "
        f"whole; {len(graphs.graphs)} buckets captured in {graphs.capture_seconds:.1f} s, "
        f"{graphs.capture_bytes / 2**20:.0f} MiB"
    )
    figures = {"greedy_positions": same, "whole": whole, "buckets": len(graphs.graphs)}
    figures |= {"capture_s": graphs.capture_seconds, "capture_bytes": graphs.capture_bytes}
    return Result(name, "PASS" if same >= minimum else "FAIL", detail, figures)


FLASHINFER_TITLE = "GPU check: FlashInfer's paged kernels against the SDPA path"
FLASHINFER_TEXT = (
    "bench/gpu_check.sh's FlashInfer step on a lent GPU machine (flashinfer-python carried as a "
    "wheel), on the compute-bound random Llama in bfloat16: one planned step's attention and "
    "greedy tokens against the SDPA path, and output tok/s with and without FlashInfer "
    "(alternating, best of 2).\n\n"
)
# FlashInfer against the SDPA path, both bfloat16: one step's attention output (bf16 rounding of
# two different kernels: ~1e-2 on outputs of magnitude ~1), greedy positions on random weights
# (near-ties are common there, and one differing token changes the rest of a prompt).
FLASHINFER_MAX_DIFF = 5e-2
FLASHINFER_MIN_GREEDY = 0.5
# Throughput workload: as bench.engine_throughput's GPU run, 64 requests at once.
FLASHINFER_REQUESTS, FLASHINFER_PROMPT, FLASHINFER_OUTPUT = 64, 128, 128


def check_flashinfer(device: str) -> Result:
    dtype, head_dim = torch.bfloat16, COMPUTE_BOUND_SHAPE["head_dim"]
    reason = flashinfer_attention.unavailable_reason(torch.device(device), dtype, head_dim, dtype)
    if reason is not None:
        return Result("flashinfer", "SKIP", reason, {})
    model = compute_bound_llama()

    def pair(**kwargs: Any) -> dict[str, Engine]:
        return {
            backend: engine(device, model, dtype="bfloat16", attention_backend=backend,
                            max_model_len=1024, **kwargs)
            for backend in ("sdpa", "flashinfer")
        }  # fmt: skip

    fp8 = pair(kv_cache_dtype="fp8", kv_cache_memory=256 * 2**20)
    fp8_diff = step_attention_diff(fp8["sdpa"], fp8["flashinfer"])
    del fp8
    engines = pair(max_num_seqs=64, kv_cache_memory=2 * 2**30)
    diff = step_attention_diff(engines["sdpa"], engines["flashinfer"])
    same, whole = agreement(run_greedy(engines["flashinfer"]), run_greedy(engines["sdpa"]))
    engines["flashinfer eager"] = engine(
        device, model, dtype="bfloat16", attention_backend="flashinfer", max_model_len=1024,
        max_num_seqs=64, kv_cache_memory=2 * 2**30, enforce_eager=True,
    )  # fmt: skip
    graph_same, graph_whole = agreement(
        run_greedy(engines["flashinfer"]), run_greedy(engines["flashinfer eager"])
    )
    rates = {backend: 0.0 for backend in engines}
    for _ in range(2):  # alternating, best of 2
        for backend, eng in engines.items():
            rates[backend] = max(rates[backend], output_rate(eng))
    ratio = rates["flashinfer"] / rates["sdpa"]
    is_ok = max(diff, fp8_diff) <= FLASHINFER_MAX_DIFF and same >= FLASHINFER_MIN_GREEDY
    is_ok = is_ok and graph_same >= GRAPH_MIN_GREEDY["bfloat16"]
    detail = (
        f"flashinfer-python {flashinfer_attention.version()}; one step's attention vs SDPA max abs "
        f"diff {diff:.2e}, with fp8 KV {fp8_diff:.2e} (<= {FLASHINFER_MAX_DIFF:g}); greedy as the "
        f"SDPA engine {same:.1%} of "
        f"positions (>= {FLASHINFER_MIN_GREEDY:.0%}), {whole}/32 whole; output tok/s at "
        f"{FLASHINFER_REQUESTS} x {FLASHINFER_PROMPT}+{FLASHINFER_OUTPUT} tokens: FlashInfer "
        f"{rates['flashinfer']:.0f}, SDPA {rates['sdpa']:.0f} ({ratio:.2f}x) (both with CUDA "
        f"graphs); FlashInfer with graphs against --enforce-eager: greedy {graph_same:.1%} of "
        f"positions (>= {GRAPH_MIN_GREEDY['bfloat16']:.0%}), {graph_whole}/32 whole, eager "
        f"{rates['flashinfer eager']:.0f} tok/s"
    )
    figures = {"max_attention_diff": diff, "fp8_max_attention_diff": fp8_diff}
    figures |= {"greedy_positions": same, "whole": whole}
    figures |= {"flashinfer_tok_s": rates["flashinfer"], "sdpa_tok_s": rates["sdpa"]}
    figures |= {"graph_greedy_positions": graph_same, "eager_tok_s": rates["flashinfer eager"]}
    return Result("flashinfer/bfloat16", "PASS" if is_ok else "FAIL", detail, figures)


def step_attention_diff(sdpa: Engine, flashinfer: Engine) -> float:
    """Max |FlashInfer - SDPA| over one layer's attention for a step with decodes of several
    lengths, a decode with 3 proposals, a fresh chunk and chunks over cached KV. Keys and values
    are exact in fp8 (fp8_exact), so with an fp8 cache too both read the same numbers."""
    torch.manual_seed(0)
    runner = sdpa.runner
    cfg, device = runner.model.cfg, runner.device
    k_cache, v_cache = runner.kv_caches[0]
    for pool in (k_cache, v_cache):
        pool.data.copy_(fp8_exact(*pool.data.shape, device=device).div_(pool.scale))
    # MIXED_STEP's longest contexts made longer: several of FlashInfer's pages per row
    contexts = [(computed * 5, new, drafts) for computed, new, drafts in MIXED_STEP]
    batch = mixed_batch(k_cache.data.shape[0], contexts)
    rows = sum(item.num_new_tokens for item in batch)
    q = torch.randn(rows, cfg.num_heads, cfg.head_dim, device=device, dtype=runner.model.dtype)
    k, v = fp8_exact(2, rows, cfg.num_kv_heads, cfg.head_dim, device=device).to(q.dtype).unbind(0)
    scale = cfg.head_dim**-0.5
    outputs = []
    for eng in (sdpa, flashinfer):
        _, _, meta, _ = eng.runner.prepare(batch)
        outputs.append(paged_attention(q, k, v, k_cache, v_cache, meta, scale).float())
    return float((outputs[0] - outputs[1]).abs().max())


def output_rate(eng: Engine) -> float:
    """Output tokens per second of FLASHINFER_REQUESTS random prompts run together."""
    vocab = eng.model_config.vocab_size
    params = SamplingParams(max_tokens=FLASHINFER_OUTPUT, temperature=0, ignore_eos=True)
    generator = torch.Generator().manual_seed(1)
    for index in range(FLASHINFER_REQUESTS):
        prompt = torch.randint(3, vocab, (FLASHINFER_PROMPT,), generator=generator).tolist()
        eng.add_request(prompt, params, f"rate-{index}")
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else lambda: None
    sync()
    start, tokens = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        tokens += sum(len(out.new_token_ids) for out in eng.step())
    sync()
    return tokens / (time.perf_counter() - start)


def gpu_used_bytes(index: int) -> int:
    """Memory in use on one GPU by every process (this one's context included)."""
    free, total = torch.cuda.mem_get_info(index)
    return total - free


def timed(fn: Any, *args: Any) -> Result:
    start = time.perf_counter()
    try:
        result: Result = fn(*args)
    except Exception as error:  # one broken check must not hide the others' figures
        result = Result(f"{fn.__name__}{args}", "FAIL", f"{type(error).__name__}: {error}", {})
    result.figures["seconds"] = round(time.perf_counter() - start, 1)
    print(f"{result.status:4} {result.name}: {result.detail} [{result.figures['seconds']} s]")
    return result


def markdown(results: list[Result], device: str) -> str:
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    lines = [
        f"Device: {name} (torch {torch.__version__}, {torch.cuda.device_count()} GPU(s)).",
        "",
        "| check | result | figures |",
        "|---|---|---|",
    ]
    lines += [f"| {r.name} | {r.status} | {r.detail} |" for r in results]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--flashinfer",
        action="store_true",
        help="only the FlashInfer check (its own step: FlashInfer compiles its kernels first)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu.check: CUDA is not available (use --device cpu for the dry run)")
        return 2
    torch.manual_seed(0)
    if args.flashinfer:
        results = [timed(check_flashinfer, args.device)]
        name, title, text = "gpu_flashinfer", FLASHINFER_TITLE, FLASHINFER_TEXT
    else:
        results = [timed(check_parity, args.device, q, d) for q, d in PARITY_BOUNDS]
        results += [timed(check_fp8, args.device, "float32")]
        if args.device == "cuda":
            results += [timed(check_fp8, args.device, "bfloat16")]
        results += [timed(check_tensor_parallel, args.device)]
        results += [timed(check_cuda_graphs, args.device, d) for d in ("float32", "bfloat16")]
        results += prequant_results(args.device)
        name, title, text = "gpu_check", TITLE, DOC_TEXT
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    (args.out / f"{name}.md").write_text(markdown(results, args.device))
    ran = any(r.status != "SKIP" for r in results)
    if args.device == "cuda" and ran:  # the CPU dry run checks the script, not the GPU path
        write_section(name, title, command_line("bench.gpu.check", argv), text
                      + markdown(results, args.device))  # fmt: skip
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
