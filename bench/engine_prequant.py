"""Pre-quantised checkpoints (issue 39): start-up load time of compressed-tensors, GPTQ and AWQ
int4 checkpoints against quantising the 16-bit checkpoint to int4 at start, decode speed of
each (all run the same int4 kernels; a checkpoint's values are repacked, never requantised), and
tiny-llama's perplexity on models/tiny-llama/eval.txt against transformers on the same GPTQ/AWQ
checkpoint (goal: within 0.5%).

    .venv/bin/python -m bench.engine_prequant [--rounds 3] [--decode-steps 16] [--tiny-only]
        [--formats compressed-tensors,compressed-tensors-lm-head,gptq,gptq-lm-head,awq]
        [--compute-bound-formats ...]

Load time: wall-clock seconds of `Engine(...)` (config, tokenizer, weights read and packed, KV
pool allocated), best of `--rounds` alternating rounds, files in the page cache (each loaded once
before timing). Decode: bench.engine_quant's measure (tokens per CPU-second, bf16 compute, one
torch thread), against the engine's own int4 and, like with like, against its own int4 with the
embedding (and the lm_head, where the checkpoint leaves it bf16) put back in bf16. The int4
checkpoints are written by compressed-tensors (bench/reference/prequantized.py) into a temporary
directory: tiny-llama channel-wise (every linear layer; its 688 MLP features take no group of
128), the compute-bound Llama in groups of 128; the `-lm-head` formats quantise the lm_head too,
the model untied first. GPTQ (act-order, group 128; `gptq-lm-head` with `lm_head: true`) and AWQ
(group 128) checkpoints are written by GPTQModel in its own tool venv, once, into
~/.cache/kvpilot/gptq-refs (bench/reference/gptq_awq.py; calibrated on 8 paragraphs of
eval.txt); AWQ leaves tiny-llama's MLP 16-bit (its scale search needs features that divide by
64).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.engine_common import MODEL, compute_bound_llama, setup_threads
from bench.engine_quant import decode_tokens_per_second, greedy, verdict
from bench.reference import gptq_awq, prequantized
from bench.report import command_line, markdown_table, write_section
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.layers.quant import DenseWeight

LOAD_RATIO_TARGET = 0.35  # checkpoint load time / quantise-at-start load time (issue 39)
DECODE_RATIO_TARGET = 1.0  # checkpoint decode tok/s / own int4's
PERPLEXITY_TARGET = 0.005  # |ours / transformers' - 1| on the same checkpoint
NONE: frozenset[str] = frozenset()  # nothing put back in bf16


def make_engine(path: Path, quantization: str, sixteen_bit: frozenset[str] = NONE) -> Engine:
    """`sixteen_bit`: the matrices (weight_slots' names) put back in bf16 after it started."""
    engine = _engine(path, quantization)
    if sixteen_bit:
        bf16 = _engine(path, "none")
        keep_16_bit(engine, bf16, sixteen_bit)
        bf16.shutdown()  # its matrices live on in `engine`
    return engine


def _engine(path: Path, quantization: str) -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            quantization=quantization,
            dtype="bfloat16",
            device="cpu",
            max_model_len=256,
            max_num_seqs=32,
            kv_cache_memory=64 * 2**20,
        )
    )


def weight_slots(engine: Engine) -> dict[str, tuple[object, str]]:
    """Every matrix of the model by name: (the object holding it, its attribute)."""
    model = engine.runner.model
    slots: dict[str, tuple[object, str]] = {"embedding": (model, "embed")}
    slots["lm_head"] = (model, "lm_head")
    for index, layer in enumerate(model.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            slots[f"{index}.{name}"] = (getattr(layer, name), "weight")
    return slots


def kept_16_bit(checkpoint: Engine) -> frozenset[str]:
    """The matrices a checkpoint keeps 16-bit, served as stored (its quantiser packs Linear
    modules only, the lm_head too where asked, never the embedding; AWQ may skip the MLP)."""
    slots = weight_slots(checkpoint)
    return frozenset(
        k for k, (o, attr) in slots.items() if isinstance(getattr(o, attr), DenseWeight)
    )


def keep_16_bit(engine: Engine, bf16: Engine, names: frozenset[str]) -> None:
    """The engine's own int4 with the matrices `names` taken from a bf16 engine of the same
    model: the like-with-like baseline of a checkpoint's decode speed (both read the same bytes
    per step). A tied lm_head keeps the int4 embedding's matrix unless it is named too."""
    ours, theirs = weight_slots(engine), weight_slots(bf16)
    for name in names:
        holder, attr = ours[name]
        source, source_attr = theirs[name]
        setattr(holder, attr, getattr(source, source_attr))


def describe(names: frozenset[str], num_layers: int) -> str:
    """`names` in words: 'embedding, lm_head and MLP'."""
    words: list[str] = [w for w in ("embedding", "lm_head") if w in names]
    for part, modules in (("attention", ("qkv", "o")), ("MLP", ("gate_up", "down"))):
        layers = [f"{i}.{m}" for i in range(num_layers) for m in modules]
        if all(name in names for name in layers):
            words.append(part)
        elif any(name in names for name in layers):
            words.append(f"some {part}")
    return ", ".join(words[:-1]) + f" and {words[-1]}" if len(words) > 1 else "".join(words)


def load_seconds(path: Path, quantization: str) -> float:
    start = time.perf_counter()
    engine = make_engine(path, quantization)
    elapsed = time.perf_counter() - start
    engine.shutdown()
    return elapsed


# load_seconds in a new interpreter: its imports and start are not timed, the engine's are.
FRESH_LOAD = """
import sys
from pathlib import Path
from bench.engine_common import setup_threads
from bench.engine_prequant import load_seconds
setup_threads()
print(load_seconds(Path(sys.argv[1]), sys.argv[2]))
"""
REPO_ROOT = Path(__file__).resolve().parent.parent


def fresh_load_seconds(path: Path, quantization: str) -> float:
    """The engine's start in a process of its own, as a pod's is: every page it writes is
    new, where a start after another engine's in the same process reuses what that freed."""
    command = [sys.executable, "-c", FRESH_LOAD, str(path), quantization]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    return float(done.stdout.split()[-1])


def starts(source: Path, checkpoints: dict[str, Path]) -> dict[str, tuple[Path, str]]:
    """What each start loads, and at which --quantization: the own int4 and each checkpoint."""
    return {OWN: (source, "int4"), **{name: (path, "none") for name, path in checkpoints.items()}}


def in_turn(names: list[str], round_index: int) -> list[str]:
    """The names from a start rotated each round: the start after a bigger engine's teardown
    faults in the memory that one gave back, and no start should always be that one."""
    first = round_index % len(names)
    return names[first:] + names[:first]


def fresh_rows(
    label: str, source: Path, checkpoints: dict[str, Path], rounds: int
) -> list[list[object]]:
    """Each checkpoint's start and the own int4's, each in a fresh process, best of `rounds`
    (the order rotated each round)."""
    loaded = starts(source, checkpoints)
    loads = dict.fromkeys(loaded, float("inf"))
    for round_index in range(rounds):
        for name in in_turn(list(loaded), round_index):
            loads[name] = min(loads[name], fresh_load_seconds(*loaded[name]))
    rows: list[list[object]] = []
    for name in checkpoints:
        ratio = loads[name] / loads[OWN]
        rows.append([
            label, name, f"{loads[OWN]:.2f}", f"{loads[name]:.2f}",
            f"{ratio:.2f}x ({verdict(ratio <= LOAD_RATIO_TARGET)})",
        ])  # fmt: skip
    return rows


OWN = "own int4"
# Per checkpoint its baseline's name, and per baseline the matrices it keeps bf16.
Baselines = tuple[dict[str, str], dict[str, frozenset[str]]]


def baselines_of(checkpoints: dict[str, Path]) -> Baselines:
    """Each checkpoint's like-with-like baseline: the engine's own int4 with what the checkpoint
    keeps 16-bit put back in bf16. Returns (checkpoint -> baseline, baseline -> its matrices)."""
    of, kept = {}, {}
    for name, path in checkpoints.items():
        engine = make_engine(path, "none")
        names, num_layers = kept_16_bit(engine), len(engine.runner.model.layers)
        engine.shutdown()
        baseline = f"own int4, bf16 {describe(names, num_layers)}" if names else OWN
        of[name], kept[baseline] = baseline, names
    return of, kept


def measure(
    label: str,
    source: Path,
    checkpoints: dict[str, Path],
    baselines: Baselines,
    args: argparse.Namespace,
) -> list[list[object]]:
    """One row per checkpoint, each against the same model quantised at start (`own int4`),
    and its decode against that with what it keeps 16-bit put back in bf16."""
    loaded = starts(source, checkpoints)
    for path, level in loaded.values():  # warm the page cache and the kernels' first use
        load_seconds(path, level)
    baseline_of, kept = baselines
    loads = dict.fromkeys(loaded, float("inf"))
    rates = dict.fromkeys([*kept, *loaded], 0.0)
    for round_index in range(args.rounds):
        for name in in_turn(list(loaded), round_index):
            loads[name] = min(loads[name], load_seconds(*loaded[name]))
        for name in rates:
            path, level = loaded.get(name, (source, "int4"))
            engine = make_engine(path, level, kept.get(name, NONE))
            rate = decode_tokens_per_second(engine, 1, args.decode_steps)
            rates[name] = max(rates[name], rate)
            engine.shutdown()
    return [_row(label, name, loads, rates, baseline_of[name]) for name in checkpoints]


def op_rows(
    label: str, source: Path, checkpoints: dict[str, Path], baselines: Baselines
) -> list[list[object]]:
    _, kept = baselines
    cases = {OWN: (source, "int4", NONE)}
    cases |= {name: (source, "int4", names) for name, names in kept.items()}
    cases |= {name: (path, "none", NONE) for name, path in checkpoints.items()}
    return [[label, name, *ops_per_decode_step(*case)] for name, case in cases.items()]


PROFILED_STEPS = 8
COUNTED_OPS = {  # column -> torch.profiler's op name
    "int4 matmuls": "aten::_weight_int4pack_mm_for_cpu",
    "bf16 matmuls": "aten::mm",
    "gathers": "aten::index_select",
}


def ops_per_decode_step(path: Path, level: str, sixteen_bit: frozenset[str]) -> list[object]:
    """What one decode step runs (torch.profiler, concurrency 1): counts, not times, so a
    shared machine does not blur where a checkpoint's step differs from the own int4's."""
    from torch.profiler import ProfilerActivity, profile

    engine = make_engine(path, level, sixteen_bit)
    engine.add_request(list(range(10, 42)), greedy(2 + PROFILED_STEPS), "profiled")
    engine.step()  # the prefill
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED_STEPS):
            engine.step()
    engine.shutdown()
    counts = {event.key: event.count for event in prof.key_averages()}
    aten = sum(n for key, n in counts.items() if key.startswith("aten::"))
    columns = [counts.get(op, 0) for op in COUNTED_OPS.values()] + [aten]
    return [f"{n / PROFILED_STEPS:g}" for n in columns]


def _row(
    label: str, name: str, loads: dict[str, float], rates: dict[str, float], baseline: str
) -> list[object]:
    load_ratio, decode_ratio = loads[name] / loads[OWN], rates[name] / rates[OWN]
    like_ratio = rates[name] / rates[baseline]
    return [
        label,
        name,
        f"{loads[OWN]:.2f}",
        f"{loads[name]:.2f}",
        f"{load_ratio:.2f}x ({verdict(load_ratio <= LOAD_RATIO_TARGET)})",
        f"{rates[OWN]:.1f}",
        f"{rates[name]:.1f}",
        f"**{decode_ratio:.2f}x ({verdict(decode_ratio >= DECODE_RATIO_TARGET)})**",
        f"{baseline}: {rates[baseline]:.1f}",
        f"{like_ratio:.2f}x",
    ]


# Per format, the variant written for tiny-llama and for the compute-bound Llama.
VARIANTS = {
    "compressed-tensors": ("int4-channel", "int4-g128-all"),
    "compressed-tensors-lm-head": ("int4-channel-head", "int4-g128-all-head"),
    "gptq": ("gptq-g128-desc", "gptq-g128-desc"),
    "gptq-lm-head": ("gptq-g128-desc-head", "gptq-g128-desc-head"),
    "awq": ("awq-g128", "awq-g128-all"),
}
HEAD_SUFFIX = ", lm_head int4"  # the label of a checkpoint that quantised its lm_head
LABELS = {
    "int4-channel": "compressed-tensors int4 channel",
    "int4-channel-head": "compressed-tensors int4 channel" + HEAD_SUFFIX,
    "int4-g128-all": "compressed-tensors int4 g128",
    "int4-g128-all-head": "compressed-tensors int4 g128" + HEAD_SUFFIX,
    "gptq-g128-desc": "GPTQ g128 desc_act",
    "gptq-g128-desc-head": "GPTQ g128 desc_act" + HEAD_SUFFIX,
    "awq-g128": "AWQ g128 (attention only)",
    "awq-g128-all": "AWQ g128",
}


def write_checkpoints(
    scratch: Path, source: Path, formats: list[str], compute_bound: bool
) -> dict[str, Path]:
    written = {}
    for fmt in formats:
        variant = VARIANTS[fmt][compute_bound]
        if fmt.startswith("compressed-tensors"):
            out = Path(scratch) / f"{source.name}-{variant}"
            written[LABELS[variant]] = prequantized.write_checkpoint(out, variant, source)
        else:  # GPTQModel's, from the reference cache (its tool venv writes it the first time)
            written[LABELS[variant]] = gptq_awq.reference_checkpoint(variant, source)
    return written


def perplexity_rows(checkpoints: dict[str, Path]) -> list[list[object]]:
    """tiny-llama's perplexity on eval.txt, ours (float32) against transformers on the same
    GPTQ/AWQ checkpoint dequantised by GPTQModel, through the eval module's windows."""
    import math

    import torch

    from kvpilot.runtime.engine.model_runner import load_model
    from kvpilot.runtime.evaluate import samples_for, score
    from kvpilot.runtime.models.loader import load_model_config
    from kvpilot.runtime.models.tokenizer_files import Tokenizer

    rows: list[list[object]] = []
    cpu = torch.device("cpu")
    for name, path in checkpoints.items():
        if name.startswith("compressed-tensors"):
            continue  # tests/runtime/test_rt_prequant.py measures those
        samples = samples_for("perplexity", MODEL / "eval.txt", Tokenizer(path), 512)
        model = load_model(path, load_model_config(path), "none", torch.float32, cpu)
        scores = score(model, samples, cpu, None)
        ours = math.exp(scores.nll / scores.num_targets)
        reference = _hf_perplexity(gptq_awq.dequantized_model(path), [s.ids for s in samples])
        ratio = ours / reference - 1
        met = verdict(abs(ratio) < PERPLEXITY_TARGET)
        rows.append([name, f"{reference:.3f}", f"{ours:.3f}", f"{ratio:+.3%} ({met})"])
    return rows


def _hf_perplexity(hf: object, windows: list[list[int]]) -> float:
    import math

    import torch
    import torch.nn.functional as F  # noqa: N812 - the torch convention

    nll, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            logits = hf(torch.tensor([ids])).logits[0, :-1].float()  # type: ignore[operator]
            nll += float(F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
            count += len(ids) - 1
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument(
        "--fresh-rounds", type=int, default=3, help="rounds of starts in fresh processes"
    )
    parser.add_argument("--tiny-only", action="store_true", help="skip the compute-bound model")
    parser.add_argument("--formats", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument(
        "--compute-bound-formats", help="comma-separated; default: --formats (GPTQModel's AWQ "
        "and GPTQ on that model take long on a CPU)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    formats = _formats(parser, "--formats", args.formats)
    bound_formats = _formats(parser, "--compute-bound-formats", args.compute_bound_formats)
    setup_threads()
    rows, fresh, perplexities, ops = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="kvpilot-prequant-") as scratch:
        models = [("tiny-llama (4 M)", MODEL, formats, False)]
        if not args.tiny_only:
            bound = ("compute-bound (~245 M)", compute_bound_llama())
            models.append((*bound, bound_formats or formats, True))
        for label, source, model_formats, compute_bound in models:
            checkpoints = write_checkpoints(Path(scratch), source, model_formats, compute_bound)
            baselines = baselines_of(checkpoints)  # engines of every checkpoint: once
            rows += measure(label, source, checkpoints, baselines, args)
            fresh += fresh_rows(label, source, checkpoints, args.fresh_rounds)
            ops += op_rows(label, source, checkpoints, baselines)
            if not compute_bound:
                perplexities = perplexity_rows(checkpoints)
    body = _body(args, rows, fresh, ops, perplexities)
    write_section(
        "engine_prequant",
        "Engine: pre-quantised int4 checkpoints (compressed-tensors, GPTQ, AWQ) vs quantising",
        command_line("bench.engine_prequant", argv),
        body,
    )
    print(body)
    return 0


def _formats(parser: argparse.ArgumentParser, flag: str, value: str | None) -> list[str]:
    formats = value.split(",") if value else []
    if unknown := set(formats) - set(VARIANTS):
        parser.error(f"{flag}: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    return formats


def _body(
    args: argparse.Namespace,
    rows: list[list[object]],
    fresh: list[list[object]],
    ops: list[list[object]],
    perplexities: list[list[object]],
) -> str:
    table = markdown_table(
        [
            "model",
            "checkpoint",
            "load: quantise bf16 at start (s)",
            "load: checkpoint (s)",
            f"checkpoint / at start (target <= {LOAD_RATIO_TARGET})",
            "decode tok/s: own int4",
            "decode tok/s: checkpoint",
            f"checkpoint / own int4 (target >= {DECODE_RATIO_TARGET})",
            "like-with-like baseline: decode tok/s",
            "checkpoint / like with like",
        ],
        rows,
    )
    fresh_table = markdown_table(
        [
            "model",
            "checkpoint",
            "fresh process: quantise bf16 at start (s)",
            "fresh process: checkpoint (s)",
            f"checkpoint / at start (target <= {LOAD_RATIO_TARGET})",
        ],
        fresh,
    )
    op_table = markdown_table(
        ["model", "weights", *(f"{c} per decode step" for c in COUNTED_OPS), "aten ops per step"],
        ops,
    )
    quality = markdown_table(
        [
            "tiny-llama checkpoint",
            "perplexity: transformers",
            "perplexity: kvpilot",
            f"difference (target within {PERPLEXITY_TARGET:.1%})",
        ],
        perplexities,
    )
    return (
        "Load: wall seconds of the engine's start (weights read and packed, KV pool allocated), "
        f"best of {args.rounds} rounds, each loading all in turn from a rotated start (the "
        "load after a bigger engine's teardown faults in the memory it gave back), files in the "
        "page cache. Decode: tokens per "
        f"CPU-second at concurrency 1, bf16 compute, {args.decode_steps} timed steps, best of "
        f"{args.rounds}. All run the same int4 kernels; a checkpoint's values are repacked at "
        "load, never requantised. The engine's own int4 packs the tied embedding, so its lm_head "
        "too. The published checkpoints usually leave the lm_head bf16 (llm-compressor's "
        "recipes put it in `ignore`, GPTQ's `lm_head` defaults to false): the rows without "
        f"`{HEAD_SUFFIX.lstrip(', ')}` are such checkpoints, served as stored, whose logits "
        "matmul reads 4x the own int4's bytes. The rows with it quantised the lm_head too "
        "(compressed-tensors with lm_head among its targets, GPTQModel `lm_head=True`); tiny-llama "
        "and the compute-bound model tie it to the embedding, so they were untied first, as "
        "llm-compressor does (GPTQModel refuses a tied one): the embedding stays bf16 beside "
        "an int4 lm_head. The like-with-like baseline is the engine's own int4 with what the "
        "checkpoint keeps bf16 (found in the engine serving it) put back in bf16 "
        "(`keep_16_bit`): the embedding and lm_head, the embedding alone, or those and the "
        "MLP. GPTQ act-order adds a gather of the input of q/k/v, o_proj and "
        "gate/up per layer (down_proj's permutation is folded into gate/up's rows at load; the "
        "lm_head's input too where it was written with act-order, which the GPTQ lm_head "
        "rows' was not). AWQ on tiny-llama quantises attention only "
        "(GPTQModel's scale search leaves its MLP bf16, the checkpoint's choice).\n\n"
        + table
        + "\n\nThe same starts each in a process of its own, as a pod's start is (the engine's "
        "construction timed inside a new interpreter, its imports not; best of "
        f"{args.fresh_rounds} rounds, the order rotated): every page the start writes is new, "
        "where a start after another engine's in one process reuses what that freed, and the "
        "first start of a process also makes what a process makes once (the int4 tile height "
        "probe, the tokenizer, the threads' pools).\n\n"
        + fresh_table
        + f"\n\nWhat a decode step runs (torch.profiler over {PROFILED_STEPS} steps at "
        "concurrency 1; op counts, which a shared machine does not blur):\n\n"
        + op_table
        + "\n\nPerplexity on models/tiny-llama/eval.txt (512-token windows, float32): transformers "
        "on the checkpoint as GPTQModel dequantises it, against kvpilot serving it packed "
        "(compressed-tensors': tests/runtime/test_rt_prequant.py).\n\n"
        + (quality if perplexities else "(no GPTQ/AWQ checkpoint in this run)")
    )


if __name__ == "__main__":
    sys.exit(main())
