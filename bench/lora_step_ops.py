"""What LoRA adds to one engine step, for bench.engine_lora: a closed loop's step plans
(model_runner.StepPlan) recorded, then one decode step and one prefill step replayed through the
model runner with the step's adapters and without them (the same plan, `lora_slots` emptied),
so only the LoRA work differs. torch.profiler counts the ops; CPU time is the minimum over
replays (a shared machine only ever adds time)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from bench.report import markdown_table
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.model_runner import StepPlan

MATMULS = ("aten::mm", "aten::bmm", "aten::addmm_", "aten::addmm", "aten::baddbmm_")
NUM_REPLAYS = 5


def record_plans(engine: Engine, run: Callable[[], object]) -> list[StepPlan]:
    """The plans of every step `run` makes the engine take."""
    runner = engine.runner
    plans: list[StepPlan] = []
    run_model = runner.run_model

    def recording(plan: StepPlan) -> torch.Tensor:
        plans.append(plan)
        return run_model(plan)

    runner.run_model = recording  # type: ignore[method-assign]
    try:
        run()
    finally:
        runner.run_model = run_model  # type: ignore[method-assign]
    return plans


def op_counts(engine: Engine, plan: StepPlan) -> tuple[int, int]:
    """(aten ops, matmuls) one replay of `plan` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.runner.run_model(plan)
    counts = {event.key: event.count for event in prof.key_averages()}
    aten = sum(n for key, n in counts.items() if key.startswith("aten::"))
    return aten, sum(counts.get(op, 0) for op in MATMULS)


def replay_ms(engine: Engine, plan: StepPlan) -> float:
    best = float("inf")
    for _ in range(NUM_REPLAYS):
        start = time.process_time()
        engine.runner.run_model(plan)
        best = min(best, time.process_time() - start)
    return best * 1000


def step_rows(engine: Engine, plans: list[StepPlan]) -> list[list[object]]:
    """One row per kind of step: the first decode-only step past the loop's start, and the
    first step with a prefill chunk."""
    decodes = [p for p in plans if not p.prefills and p.lora_slots]
    prefills = [p for p in plans if p.prefills and p.lora_slots]
    picked = {"decode": decodes[len(decodes) // 2 :][:1], "with prefill": prefills[:1]}
    rows: list[list[object]] = []
    for kind, chosen in picked.items():
        for plan in chosen:
            base = dataclasses.replace(plan, lora_slots=[])
            ops = [op_counts(engine, p) for p in (base, plan)]
            ms = [replay_ms(engine, p) for p in (base, plan)]
            rows.append([
                f"{kind} ({len(plan.input_ids)} rows)", ops[0][0], ops[1][0], ops[0][1],
                ops[1][1], f"{ms[0]:.2f}", f"{ms[1]:.2f}", f"{ms[0] / ms[1]:.2f}",
            ])  # fmt: skip
    return rows


def step_table(engine: Engine, plans: list[StepPlan]) -> str:
    headers = [
        "step", "aten ops, base", "with LoRA", "matmuls, base", "with LoRA",
        "forward ms, base", "with LoRA", "base / LoRA",
    ]  # fmt: skip
    return markdown_table(headers, step_rows(engine, plans))
