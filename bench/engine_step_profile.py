"""Engine: where a decode step at 64 sequences spends its CPU time (issue 19 item 5).

    .venv/bin/python -m bench.engine_step_profile [--models tiny,compute] [--steps 30]
        [--num-seqs 64] [--prompt-len 128] [--rounds 2] [--attention-backends sdpa,paged]

--num-seqs sequences with random token-id prompts of --prompt-len tokens are prefilled, then --steps
decode steps are timed, each phase with the process's CPU time (one torch thread: on a shared
machine wall time measures the neighbours). The phases are the engine's own calls, timed by
wrapping them on this engine instance: scheduling (Scheduler.schedule), the step plan
(model_runner.plan_step: flat ids, positions, slots, block tables as Python lists), the forward
(ModelRunner.run_model: the plan as tensors, then the layers, less their attention), the
attention (layers.attention.paged_attention: writing the new keys and values, then per decode group
the copy of its blocks out of the paged cache, `PagedCache.gather`, and the attention kernel over
that copy, SDPA; or with `--attention-backend paged` one kernel call that reads the blocks in
place, no gather), the logits (lm_head), the sampler,
and the rest of Engine.step (per-sequence output handling: appending the token, stop checks,
incremental detokenisation, the stats snapshot). The best of --rounds rounds per model (the
lowest total), each attention backend side by side in one run. Models: tiny-llama (4 M
parameters, overhead-bound) and the compute-bound
random-weight Llama of bench.engine_common, both with `--dtype auto`.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.engine_common import MODEL, compute_bound_llama, greedy, setup_threads, threads_note
from bench.report import command_line, markdown_table, write_section
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine import model_runner
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.layers.kv_cache import PagedCache
from kvpilot.runtime.models import llama

PHASES = ("schedule", "plan", "forward", "attention", "kv gather", "logits", "sample")
# Timed inside another phase, reported apart: forward less attention, attention less its gathers.
NESTED = {"forward": "attention", "attention": "kv gather"}


@dataclass
class PhaseTimes:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    total: float = 0.0

    def timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.process_time() - started

        return run


def decoding_engine(
    model: Path, num_seqs: int, num_steps: int, prompt_len: int, attention_backend: str
) -> Engine:
    """An engine whose `num_seqs` sequences have all been prefilled and are decoding."""
    config = EngineConfig(
        model=str(model), device="cpu", max_model_len=prompt_len + num_steps + 64,
        max_num_seqs=num_seqs, attention_backend=attention_backend,
    )  # fmt: skip
    engine = Engine(config)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    for index in range(num_seqs):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(prompt, greedy(num_steps + 8), f"profile-{index}")
    scheduler = engine.scheduler

    def is_prefilling() -> bool:
        # Requests wait in the engine's inbox until a step takes them: count the running ones.
        running = scheduler.running
        return len(running) < num_seqs or any(s.num_output_tokens == 0 for s in running)

    while is_prefilling():
        engine.step()
    engine.step()  # one decode-only step before timing
    return engine


def profile(engine: Engine, num_steps: int) -> PhaseTimes:
    """Time `num_steps` decode steps, phase by phase (wrapping this engine's calls only; the
    module-level functions and PagedCache.gather are put back afterwards)."""
    times = PhaseTimes()
    runner = engine.runner
    originals = (model_runner.plan_step, model_runner.sample, llama.paged_attention)
    gather = PagedCache.gather
    engine.scheduler.schedule = times.timed("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    runner.run_model = times.timed("forward", runner.run_model)  # type: ignore[method-assign]
    runner.model.compute_logits = times.timed("logits", runner.model.compute_logits)  # type: ignore[method-assign]
    model_runner.plan_step = times.timed("plan", model_runner.plan_step)
    model_runner.sample = times.timed("sample", model_runner.sample)
    llama.paged_attention = times.timed("attention", llama.paged_attention)
    PagedCache.gather = times.timed("kv gather", gather)  # type: ignore[method-assign]
    try:
        for _ in range(num_steps):
            started = time.process_time()
            engine.step()
            times.total += time.process_time() - started
    finally:
        model_runner.plan_step, model_runner.sample, llama.paged_attention = originals
        PagedCache.gather = gather  # type: ignore[method-assign]
    for outer, inner in NESTED.items():
        times.seconds[outer] -= times.seconds[inner]
    return times


def rows(by_backend: dict[str, PhaseTimes], num_steps: int) -> list[list[object]]:
    """One row per phase, ms and share per backend side by side."""

    def cells(times: PhaseTimes, seconds: float) -> list[object]:
        return [f"{1000 * seconds / num_steps:.2f}", f"{100 * seconds / times.total:.0f}%"]

    def rest(times: PhaseTimes) -> float:
        return times.total - sum(times.seconds.values())

    table: list[list[object]] = []
    for phase in PHASES:
        table.append([phase, *(c for t in by_backend.values() for c in cells(t, t.seconds[phase]))])
    table.append(["rest of the step", *(c for t in by_backend.values() for c in cells(t, rest(t)))])
    table.append(["**attention, all**", *(
        c for t in by_backend.values()
        for c in cells(t, t.seconds["attention"] + t.seconds["kv gather"])
    )])  # fmt: skip
    steps = [f"**{1000 * t.total / num_steps:.2f}**" for t in by_backend.values()]
    table.append(["**step**", *(c for step in steps for c in (step, "100%"))])
    return table


def attention_share(times: PhaseTimes) -> float:
    return (times.seconds["attention"] + times.seconds["kv gather"]) / times.total


def target_line(title: str, by_backend: dict[str, PhaseTimes]) -> str | None:
    """Issue 19's target: the decode attention share of a step halved by reading the paged
    cache in place, against the gather and SDPA."""
    if not {"sdpa", "paged"} <= by_backend.keys():
        return None
    before, after = (attention_share(by_backend[b]) for b in ("sdpa", "paged"))
    verdict = "met" if after <= before / 2 else "not met"
    return (
        f"{title}: decode attention {after:.0%} of a step with the paged kernel, {before:.0%} "
        f"with the gather and SDPA, {after / before:.2f}x (target <= 0.5x: {verdict})"
    )


def best_times(model: Path, backend: str, args: argparse.Namespace, label: str) -> PhaseTimes:
    """The lowest-total of --rounds profiles of a fresh engine."""
    best: PhaseTimes | None = None
    for _ in range(args.rounds):
        engine = decoding_engine(model, args.num_seqs, args.steps, args.prompt_len, backend)
        times = profile(engine, args.steps)
        best = times if best is None or times.total < best.total else best
        share = attention_share(times)
        step_ms = 1000 * times.total / args.steps
        print(f"{label} {backend}: {step_ms:.1f} ms/step, attention {share:.0%}", flush=True)
    assert best is not None
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="tiny,compute", help="comma-separated: tiny, compute")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--attention-backends", default="sdpa,paged", help="comma-separated, side by side"
    )
    args = parser.parse_args(argv)
    setup_threads()
    paths = {"tiny": MODEL, "compute": None}
    body = [
        f"{args.num_seqs} sequences decoding (prompts of {args.prompt_len} random token ids, "
        "greedy), "
        f"{args.steps} steps timed, best of {args.rounds} rounds; CPU time of the process. "
        f"{threads_note()}",
    ]
    backends = args.attention_backends.split(",")
    for name in args.models.split(","):
        model = paths[name] or compute_bound_llama()
        by_backend = {backend: best_times(model, backend, args, name) for backend in backends}
        title = "tiny-llama (4 M parameters)" if name == "tiny" else "compute-bound Llama (245 M)"
        header = ["phase", *(h for b in backends for h in (f"{b}: ms per step", "share"))]
        body += [f"### {title}", markdown_table(header, rows(by_backend, args.steps))]
        target = target_line(title, by_backend)
        if target is not None:
            body.append(target)
    command = command_line("bench.engine_step_profile", argv)
    write_section(
        "engine_step_profile", "Engine: a decode step, phase by phase", command,
        "\n\n".join(body),
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
