"""Multi-LoRA: a batch mixing 8 adapters, and a Zipf mix over 100, against the base model alone;
adapter load time. On two models: tiny-llama (hidden 256, 4 layers: 8 adapter slots hold
about as many values as the base's layers, and Python sets a step's time) and the compute-bound
random Llama of engine_common (hidden 1024, 16 layers, ~245 M: an adapter is ~2% of the base,
as on the 7B-class models LoRA is served on, and the matmuls set a step's time).

    .venv/bin/python -m bench.engine_lora [--models tiny-llama,compute-bound]
        [--num-requests 96] [--output-tokens 32] [--cb-num-requests 64]
        [--cb-output-tokens 16] [--concurrency 32] [--offline-requests 512]
        [--cb-offline-requests 128] [--rounds 3] [--ab]

Throughput: `--num-requests` requests of 64-token prompts (`--cb-num-requests` on the
compute-bound model, whose steps are ~30x slower: fewer, shorter requests keep a run within
minutes on a shared CPU), greedy, `--concurrency` in flight (closed loop: a new request joins
as one finishes), through the engine in-process. Five runs per model:
the base model; round-robin over 8 random rank-16 adapters targeting every projection
(`--max-loras 8`, so one step holds all 8), then over 8 targeting q/v only; requests drawn
Zipf(1) over 100 all-projection adapters, all registered and held in host memory
(`--max-cpu-loras`), with `--max-loras 8` (adapters wait for a slot, slots are reloaded), then
the same with `--max-loras 32`. Then, labelled "offline", another shape: `--offline-requests`
(`--cb-offline-requests`) requests submitted at once, as vLLM's
benchmarks/benchmark_throughput.py --enable-lora does, the base model and the Zipf draw at
`--max-loras 8`, each ratio to the offline base (0 requests: not run). The runs go in turn in
each of `--rounds` rounds and each ratio is the median over rounds: a shared machine's load
drifts between runs. `--ab` adds a run, the 8-adapter mix with a decode-like step's adapter
rows through the padded batched matmuls of tensor ops, as before the compiled op
(layers/lora_add.cpp; layers/lora._COMPILED_ROWS off), interleaved with the rest.
On tiny-llama, the 8-adapter mix's decode and prefill steps are replayed with and without their
adapters (bench/lora_step_ops.py): aten ops, matmuls and CPU time of each.
Load: the p50 of 20 `Engine.load_lora` calls of a rank-16 adapter from local disk (read,
checked against the model, registered), wall time.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from statistics import mean
from typing import Any

import torch

from bench.engine_common import (
    MODEL,
    clock,
    compute_bound_llama,
    corpus_ids,
    fmt_ratio,
    greedy,
    median,
    setup_threads,
    threads_note,
)
from bench.lora_step_ops import record_plans, step_table
from bench.reference.lora import (
    ALL_MODULES,
    AdapterSpec,
    load_base,
    peft_model,
    save_random_adapter,
)
from bench.report import markdown_table, write_section
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.layers import lora as lora_layer
from kvpilot.runtime.models.lora_files import module_shape

NUM_MIXED = 8  # adapters in the mixed batch, and --max-loras
NUM_ZIPF = 100  # adapters registered for the Zipf mix
QV_MODULES = ("q_proj", "v_proj")
WIDE_SLOTS = 32  # --max-loras of the Zipf mix's second run: one slot per sequence in flight
ZIPF_EXPONENT = 1.0
PROMPT_TOKENS = 64
NUM_LOADS = 20


def zipf_names(num_requests: int, seed: int = 0) -> list[str | None]:
    """Each request's adapter: name k (0-based) with probability proportional to 1/(k+1)^s."""
    weights = [1 / (k + 1) ** ZIPF_EXPONENT for k in range(NUM_ZIPF)]
    picks = random.Random(seed).choices(range(NUM_ZIPF), weights, k=num_requests)
    return [f"z{k}" for k in picks]


@dataclass
class RunResult:
    tokens_per_s: float
    num_errors: int  # requests that did not finish by length
    mean_running: float  # sequences running per step: what the adapter slots let through
    num_loads: int  # adapters written into a slot during the run (kvpilot_lora_loads_total)


def run_closed_loop(
    engine: Engine, names: list[str | None], output_tokens: int, concurrency: int
) -> RunResult:
    """`names` in order (an adapter's name or None: the base), at most `concurrency` in flight."""
    ids = corpus_ids()
    slots = engine.scheduler.lora_slots
    loads_before = 0 if slots is None else slots.num_loads
    pending = deque(enumerate(names))
    num_tokens = num_errors = 0
    running: list[int] = []

    def submit() -> None:
        index, name = pending.popleft()
        lora = None if name is None else engine.lora_request(name)
        offset = (index * PROMPT_TOKENS) % (len(ids) - PROMPT_TOKENS)
        prompt = ids[offset : offset + PROMPT_TOKENS]
        engine.add_request(prompt, greedy(output_tokens), str(index), lora)

    for _ in range(min(concurrency, len(names))):
        submit()
    start = clock()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        running.append(len(engine.scheduler.running))
        for out in outputs:
            if not out.finished:
                continue
            num_tokens += out.num_output_tokens
            num_errors += out.finish_reason != "length"
            if pending:
                submit()
    num_loads = 0 if slots is None else slots.num_loads - loads_before
    return RunResult(num_tokens / (clock() - start), num_errors, mean(running), num_loads)


def multiply_adds(engine: Engine) -> tuple[int, int]:
    """Per token: the base projections' and lm_head's multiply-adds, and its adapter's (one
    slot's A and B per fused projection: the segmented LoRA of layers/lora.py)."""
    lora = engine.runner.model.lora
    if lora is None:
        raise ValueError("the engine runs without LoRA slots")
    cfg = engine.model_config
    base = cfg.num_layers * sum(
        out * in_ for out, in_ in map(partial(module_shape, cfg), ALL_MODULES)
    )
    base += cfg.vocab_size * cfg.hidden_size
    stacks = [stack for layer in lora.layers for stack in layer.stacks.values()]
    added = sum(s.a[0].numel() + s.b[0].numel() for s in stacks)  # x @ A then (.) @ B
    return base, added


def slot_bytes(engine: Engine) -> float:
    lora = engine.runner.model.lora
    if lora is None:
        raise ValueError("the engine runs without LoRA slots")
    return lora.num_bytes() / lora.num_slots


@dataclass(frozen=True)
class ModelCase:
    label: str  # as the report names it
    path: Path
    num_requests: int
    output_tokens: int
    num_offline: int  # requests of the offline shape (0: not run)
    profile_steps: bool  # the LoRA ops and time of a decode and a prefill step (lora_step_ops)
    adapter_dtype: torch.dtype  # of the base PEFT wraps: the adapters' files


def model_cases(args: argparse.Namespace) -> list[ModelCase]:
    cases = {
        "tiny-llama": lambda: ModelCase(
            "tiny-llama (hidden 256, 4 layers)", MODEL, args.num_requests,
            args.output_tokens, args.offline_requests, True, torch.float32,
        ),
        "compute-bound": lambda: ModelCase(
            "compute-bound random Llama (hidden 1024, 16 layers, ~245 M)",
            compute_bound_llama(), args.cb_num_requests, args.cb_output_tokens,
            args.cb_offline_requests, False, torch.bfloat16,
        ),
    }  # fmt: skip
    names = args.models.split(",")
    unknown = [name for name in names if name not in cases]
    if unknown:
        raise ValueError(f"--models: unknown {unknown}; choose among {sorted(cases)}")
    return [cases[name]() for name in names]


def make_adapters(
    base: Any, tmp: Path, prefix: str, count: int, targets: tuple[str, ...] = ALL_MODULES
) -> list[Path]:
    """`count` random rank-16 adapters made with peft, seeds 0..count-1: one PEFT model
    refilled per adapter (the same files as reference.make_adapter's, without a copy of the
    base each)."""
    model = peft_model(copy.deepcopy(base), AdapterSpec(prefix, 16, targets, 32))
    paths = [tmp / f"{prefix}{i}" for i in range(count)]
    for i, path in enumerate(paths):
        save_random_adapter(model, i, path)
    return paths


def lora_engine(case: ModelCase, max_loras: int, adapters: dict[str, Path]) -> Engine:
    """An engine with `adapters` (name -> directory) registered, all held in host memory."""
    engine = Engine(
        EngineConfig(
            model=str(case.path), device="auto", enable_lora=True, max_loras=max_loras,
            max_lora_rank=16, max_num_seqs=64, max_model_len=256,
            enable_prefix_caching=False, max_cpu_loras=len(adapters) + NUM_LOADS,
        )
    )  # fmt: skip
    for name, path in adapters.items():
        engine.load_lora(name, str(path))
    return engine


def load_times_ms(engine: Engine, path: Path) -> list[float]:
    times = []
    for i in range(NUM_LOADS):
        start = time.perf_counter()
        engine.load_lora(f"timed{i}", str(path))
        times.append((time.perf_counter() - start) * 1000)
    return times


@dataclass(frozen=True)
class RunSpec:
    max_loras: int
    names: list[str | None]  # each request's adapter (None: the base model)
    concurrency: int | None = None  # in flight; None: --concurrency (closed loop)


Runs = dict[str, RunSpec]
OFFLINE_BASE = "offline: base model"
OFFLINE_ZIPF = f"offline: Zipf({ZIPF_EXPONENT:g}) over {NUM_ZIPF} adapters, --max-loras {NUM_MIXED}"


OLD_PATH_RUN = f"{NUM_MIXED} adapters mixed (all projections), the path before (--ab)"


@contextmanager
def lora_path(is_old: bool) -> Iterator[None]:
    """A decode-like step's adapter rows through the padded tensor ops, as before the compiled
    op (is_old), through the layer's private switch."""
    saved = lora_layer._COMPILED_ROWS
    lora_layer._COMPILED_ROWS = not is_old
    try:
        yield
    finally:
        lora_layer._COMPILED_ROWS = saved


def make_runs(num_requests: int, num_offline: int, with_ab: bool) -> Runs:
    """The closed-loop runs, then (num_offline > 0) the offline shape: every request submitted
    at once, as vLLM's benchmarks/benchmark_throughput.py does, base and Zipf."""
    n, zipf = num_requests, zipf_names(num_requests)
    ab: Runs = {OLD_PATH_RUN: RunSpec(NUM_MIXED, [f"a{i % NUM_MIXED}" for i in range(n)])}
    runs: Runs = {
        "base model": RunSpec(NUM_MIXED, [None] * n),
        f"{NUM_MIXED} adapters mixed (rank 16, all projections)": RunSpec(
            NUM_MIXED, [f"a{i % NUM_MIXED}" for i in range(n)],
        ),
        f"{NUM_MIXED} adapters mixed (rank 16, q/v only: PEFT's default)": RunSpec(
            NUM_MIXED, [f"q{i % NUM_MIXED}" for i in range(n)],
        ),
        f"Zipf({ZIPF_EXPONENT:g}) over {NUM_ZIPF} adapters, --max-loras {NUM_MIXED}": RunSpec(
            NUM_MIXED, zipf,
        ),
        f"the same Zipf mix, --max-loras {WIDE_SLOTS}": RunSpec(WIDE_SLOTS, zipf),
    }  # fmt: skip
    if num_offline > 0:
        runs[OFFLINE_BASE] = RunSpec(NUM_MIXED, [None] * num_offline, num_offline)
        runs[OFFLINE_ZIPF] = RunSpec(NUM_MIXED, zipf_names(num_offline), num_offline)
    return runs | ab if with_ab else runs


def measure(case: ModelCase, args: argparse.Namespace) -> str:
    """The five runs interleaved over `--rounds` on `case`'s model, and the load time: the
    report's text for this model."""
    runs = make_runs(case.num_requests, case.num_offline, args.ab)
    results: dict[str, list[RunResult]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        base = load_base(case.path, case.adapter_dtype)
        all_paths = make_adapters(base, Path(tmp), "a", NUM_ZIPF)
        qv_paths = make_adapters(base, Path(tmp), "q", NUM_MIXED, QV_MODULES)
        del base
        # Other names for the Zipf run's adapters: it reloads slots rather than sharing the
        # mixed run's.
        zipf = {f"z{i}": path for i, path in enumerate(all_paths)}
        mixed = {f"a{i}": all_paths[i] for i in range(NUM_MIXED)}
        mixed |= {f"q{i}": path for i, path in enumerate(qv_paths)}
        engines = {
            NUM_MIXED: lora_engine(case, NUM_MIXED, mixed | zipf),
            WIDE_SLOTS: lora_engine(case, WIDE_SLOTS, zipf),
        }
        load_ms = load_times_ms(engines[NUM_MIXED], all_paths[0])
        for _ in range(args.rounds):
            for name, spec in runs.items():
                with lora_path(is_old=name == OLD_PATH_RUN):
                    result = run_closed_loop(
                        engines[spec.max_loras], spec.names, case.output_tokens,
                        spec.concurrency or args.concurrency,
                    )  # fmt: skip
                results[name].append(result)
        steps = step_ops(case, engines[NUM_MIXED], runs, args) if case.profile_steps else ""
        macs = multiply_adds(engines[NUM_MIXED])
        slot_mib = slot_bytes(engines[NUM_MIXED]) / 2**20
        num_layers = engines[NUM_MIXED].model_config.num_layers
    text = report(case, args, runs, results, median(load_ms), macs, slot_mib, num_layers)
    return text + steps


def step_ops(case: ModelCase, engine: Engine, runs: Runs, args: argparse.Namespace) -> str:
    """The 8-adapter mix's decode and prefill steps replayed with and without their adapters."""
    mixed = runs[f"{NUM_MIXED} adapters mixed (rank 16, all projections)"].names
    plans = record_plans(
        engine, lambda: run_closed_loop(engine, mixed, case.output_tokens, args.concurrency)
    )
    return (
        f"\nWhat LoRA adds to a step of the {NUM_MIXED}-adapter mix (bench/lora_step_ops.py: "
        "a step's plan replayed through the model runner with its adapters and without; ops "
        "by torch.profiler, CPU time the minimum of 5 replays):\n\n"
        + step_table(engine, plans)
        + "\n"
    )


ZIPF_NOTE = (
    f"\nWhy the Zipf mix with --max-loras {NUM_MIXED} runs fewer rows: a step runs only the "
    "sequences of resident adapters, and a slot frees when its adapter's last running sequence "
    "ends (free slots go in queue order, engine/lora_policy.py, a starved adapter first), so "
    "the long tail waits: see 'running per step'. In this closed loop that is a bound whatever "
    "the choice (bench.lora_slot_bound): a long-tail adapter's slot serves about one request "
    "per request lifetime, so the completions, and with them the new requests, follow the "
    "tail's rate. On the compute-bound model as well: a decode step there reads all the base "
    "weights whatever its rows (a few dozen rows are memory-bound), so a step of a third of "
    f"the rows costs most of a full one. With --max-loras {WIDE_SLOTS} every row runs, but a "
    f"step holds up to {WIDE_SLOTS} adapters, and a decode step reads the A and B of each "
    "(see 'a decode step reads every slot's A and B' above, with that many slots). "
    "B is kept compact (layers/lora.py: each sub-module's own R x out, not a block-diagonal "
    "k·R x out); a slot's prefill rows are one run of rows multiplied as a slice "
    "(lora_groups.slot_runs, model_runner.batch_layout).\n"
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-llama,compute-bound")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--cb-num-requests", type=int, default=64)
    parser.add_argument("--cb-output-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--offline-requests", type=int, default=512)
    parser.add_argument("--cb-offline-requests", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--ab", action="store_true", help="also the 8-adapter mix on the path before, interleaved"
    )
    args = parser.parse_args(argv)
    setup_threads()
    load_start = os.getloadavg()[0]
    bodies = [measure(case, args) for case in model_cases(args)]
    body = (
        f"{threads_note()} Engine in-process, CPU time; 64-token prompts, greedy, "
        f"{args.concurrency} in flight (closed loop); {args.rounds} interleaved rounds, "
        "medians.\n\n"
        + "\n".join(bodies)
        + ZIPF_NOTE
        + f"\nLoad average (1 min) at the start and at the end: {load_start:.1f}, "
        f"{os.getloadavg()[0]:.1f} (2 cores, shared: the ratios are of interleaved runs).\n"
    )
    command = " ".join(["python -m bench.engine_lora", *argv])
    write_section("engine_lora", "Engine: multi-LoRA", command, body)
    print(body)
    return 0


def report(
    case: ModelCase,
    args: argparse.Namespace,
    runs: Runs,
    results: dict[str, list[RunResult]],
    load_p50_ms: float,
    macs: tuple[int, int],
    slot_mib: float,
    num_layers: int,
) -> str:
    base_name, mixed_name, qv_name, zipf_name, wide_name, *_ = runs
    tps = {name: [r.tokens_per_s for r in rounds] for name, rounds in results.items()}
    errors = {name: sum(r.num_errors for r in rounds) for name, rounds in results.items()}
    ratios = {
        name: median([r / b for r, b in zip(tps[name], tps[base_of(name, base_name)], strict=True)])
        for name in runs
    }
    rows: list[list[object]] = [
        [
            name, f"{median(tps[name]):.0f}", f"{ratios[name]:.2f}",
            f"{mean(r.mean_running for r in results[name]):.1f}",
            f"{mean(r.num_loads for r in results[name]):.0f}", errors[name],
        ]
        for name in runs
    ]  # fmt: skip
    num_distinct = len(set(runs[zipf_name].names))
    return (
        f"### {case.label}\n\n{case.num_requests} requests, {case.output_tokens} greedy "
        "tokens each.\n\n"
        + markdown_table(
            ["batch", "output tokens/s", "/ base", "running per step", "slot loads", "errors"], rows
        )
        + f"\n\n{NUM_MIXED} adapters mixed / base: {fmt_ratio(ratios[mixed_name], 0.75)}; "
        f"q/v only: {fmt_ratio(ratios[qv_name], 0.75)} (a projection no adapter of the step "
        "targets is skipped).  \n"
        f"Zipf mix over {NUM_ZIPF} adapters ({num_distinct} distinct in {case.num_requests} "
        f"requests) / base: {fmt_ratio(ratios[zipf_name], 0.6)}; errors: "
        f"{errors[zipf_name]}. With --max-loras {WIDE_SLOTS} every sequence in flight runs: "
        f"{ratios[wide_name]:.2f}x, errors: {errors[wide_name]}; a slot costs "
        f"{slot_mib:.2f} MiB here.  \n"
        f"Adapter load from local disk (rank 16, 7 projections x {num_layers} layers), p50 of "
        f"{NUM_LOADS}: {load_p50_ms:.1f} ms (target <= 100 ms: "
        f"{'met' if load_p50_ms <= 100 else 'not met'}).  \n"
        f"Per token, its adapter's {macs[1] / 1e6:.2f} M multiply-adds against the base "
        f"model's {macs[0] / 1e6:.2f} M ({macs[1] / macs[0]:.1%}); a decode step reads every "
        f"slot's A and B for its few rows, {NUM_MIXED} x {macs[1] / 1e6:.2f} M values against "
        f"the base weights' {macs[0] / 1e6:.2f} M read once for all {args.concurrency} rows "
        f"({NUM_MIXED * macs[1] / macs[0]:.2f}x).\n"
        + offline_note(runs, ratios, errors)
        + ab_note(runs, tps, mixed_name)
    )


def base_of(name: str, base_name: str) -> str:
    """The run a run's ratio is to: an offline run's is the offline base's."""
    return OFFLINE_BASE if name.startswith("offline:") else base_name


def offline_note(runs: Runs, ratios: dict[str, float], errors: dict[str, int]) -> str:
    if OFFLINE_ZIPF not in runs:
        return ""
    spec = runs[OFFLINE_ZIPF]
    return (
        f"Offline shape (another workload, not the closed loop's: all {len(spec.names)} "
        "requests submitted at once, as vLLM's benchmarks/benchmark_throughput.py "
        f"--enable-lora submits them; {len(set(spec.names))} distinct adapters; ratio to the "
        f"base model run the same way): Zipf over {NUM_ZIPF} adapters, --max-loras "
        f"{NUM_MIXED} / base: {fmt_ratio(ratios[OFFLINE_ZIPF], 0.6)}; errors: "
        f"{errors[OFFLINE_ZIPF]}. The closed-loop row above is the goal's workload; this one "
        "says what the same slots give when the scheduler sees every request at once.\n"
    )


def ab_note(runs: Runs, tps: dict[str, list[float]], mixed_name: str) -> str:
    if OLD_PATH_RUN not in runs:
        return ""
    gain = median([n / o for n, o in zip(tps[mixed_name], tps[OLD_PATH_RUN], strict=True)])
    return (
        f"A/B (--ab): the {NUM_MIXED}-adapter mix runs {gain:.2f}x the tokens/s of the path "
        "before (a decode-like step's adapter rows gathered, padded per slot, through two "
        "batched matmuls and a gather of each piece's sub-module, then index_add: about twenty "
        "aten ops per projection, where torch.ops.kvpilot.lora_add_ is one), median over rounds "
        "of the runs' ratio.\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
