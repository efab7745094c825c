"""Multi-LoRA: how many sequences a step can run when --max-loras caps the adapters per step, for
bench.engine_lora's Zipf closed loop, whatever the scheduler's choice (pure Python, no model).

    .venv/bin/python -m bench.lora_slot_bound [--num-requests 1000] [--seeds 3]

A model of the closed loop only: `--concurrency` requests in flight, each needing
`--output-tokens` steps in which its adapter is one of the step's `--max-loras`; a finished
request is replaced by the next of the Zipf draw (bench.engine_lora.zipf_names). Policies:

- held slots: a sequence runs only while its adapter holds a slot, a slot frees when no running
  sequence uses it, free slots go in queue order (the engine's rule, engine/lora_slots.py);
- held slots, most waiting first: the same, free slots to the adapters with the most sequences
  waiting, one waiting MAX_LORA_WAIT_STEPS or more first (engine/lora_policy.py's aging bound);
- pause, most running first: every sequence stays in flight holding no slot; each step runs the
  `--max-loras` adapters with the most sequences in flight, an adapter left out for more than
  `--max-pause` steps first (oldest first): adapters swapped in and out of the slots per step;
- pause, round robin: the same, the adapters least recently run first.

Rows per step over the concurrency is the ceiling of the throughput ratio to the base model when
a step with adapters costs what a base step of all the rows does, as on tiny-llama's CPU decode
steps (docs/benchmarks.md, engine_lora: the Zipf run's steps of 11.6 rows over up to 8 adapters
ran at about the base run's steps per second with 31 rows).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from statistics import mean

from bench.engine_lora import NUM_ZIPF, ZIPF_EXPONENT, zipf_names
from bench.report import markdown_table, write_section
from kvpilot.runtime.engine.lora_policy import MAX_LORA_WAIT_STEPS

ENGINE_REQUESTS = 96  # bench.engine_lora's default --num-requests


@dataclass
class InFlight:
    adapter: str
    num_left: int  # steps it still needs
    arrived: int  # step it joined
    last_run: int  # last step it ran (its arrival before the first)


# (in-flight sequences, resident adapters, step) -> the adapters this step runs
Choose = Callable[[list[InFlight], list[str], int], list[str]]


def held_slots(max_loras: int) -> Choose:
    def choose(flight: list[InFlight], resident: list[str], step: int) -> list[str]:
        keep = [a for a in resident if any(s.adapter == a for s in flight)]
        for seq in sorted(flight, key=lambda s: s.arrived):  # free slots in queue order
            if len(keep) < max_loras and seq.adapter not in keep:
                keep.append(seq.adapter)
        return keep

    return choose


def held_slots_by_demand(max_loras: int, max_wait: int) -> Choose:
    """The engine's held slots, but a free slot goes to the adapter with the most sequences
    waiting for one (S-LoRA's demand order), an adapter waiting `max_wait` steps or more first
    (the aging guard: oldest first, as engine/lora_policy.py's starved adapters)."""

    def choose(flight: list[InFlight], resident: list[str], step: int) -> list[str]:
        keep = [a for a in resident if any(s.adapter == a for s in flight)]
        waiting = [s for s in flight if s.adapter not in keep]
        count = Counter(s.adapter for s in waiting)
        since = {a: min(s.arrived for s in waiting if s.adapter == a) for a in count}
        order = sorted(count, key=lambda a: (step - since[a] < max_wait, -count[a], since[a]))
        return keep + order[: max_loras - len(keep)]

    return choose


def pause_most_running(max_loras: int, max_pause: int) -> Choose:
    def choose(flight: list[InFlight], resident: list[str], step: int) -> list[str]:
        count = Counter(s.adapter for s in flight)
        last = {a: max(s.last_run for s in flight if s.adapter == a) for a in count}
        starved = sorted((a for a in count if step - last[a] > max_pause), key=last.__getitem__)
        rest = sorted(
            (a for a in count if a not in starved), key=lambda a: (-count[a], a not in resident)
        )
        return (starved + rest)[:max_loras]

    return choose


def pause_round_robin(max_loras: int) -> Choose:
    def choose(flight: list[InFlight], resident: list[str], step: int) -> list[str]:
        last = {a: max(s.last_run for s in flight if s.adapter == a) for a in {*map(_name, flight)}}
        return sorted(last, key=lambda a: (last[a], a))[:max_loras]

    return choose


def _name(seq: InFlight) -> str:
    return seq.adapter


def run_loop(
    names: list[str], choose: Choose, concurrency: int, output_tokens: int
) -> tuple[float, float]:
    """(rows run per step, adapters loaded into a slot per step) over the whole draw."""
    pending = list(reversed(names))
    flight = [InFlight(pending.pop(), output_tokens, 0, 0) for _ in range(concurrency)]
    resident: list[str] = []
    step = num_rows = num_loads = 0
    while flight:
        step += 1
        chosen = choose(flight, resident, step)
        num_loads += sum(a not in resident for a in chosen)
        resident = chosen
        for seq in flight:
            if seq.adapter in chosen:
                seq.num_left, seq.last_run = seq.num_left - 1, step
                num_rows += 1
        num_done = sum(seq.num_left == 0 for seq in flight)
        flight = [seq for seq in flight if seq.num_left > 0]
        for _ in range(min(num_done, len(pending))):
            flight.append(InFlight(pending.pop(), output_tokens, step, step))
    return num_rows / step, num_loads / step


def tail_share(max_loras: int) -> float:
    """The Zipf draw's share of requests outside its `max_loras` most requested adapters."""
    weights = [1 / (k + 1) ** ZIPF_EXPONENT for k in range(NUM_ZIPF)]
    return 1 - sum(weights[:max_loras]) / sum(weights)


def make_policies(max_loras: int, max_pause: int) -> dict[str, Choose]:
    return {
        "held slots (the engine's rule)": held_slots(max_loras),
        f"held slots, most waiting first, {MAX_LORA_WAIT_STEPS}-step aging": held_slots_by_demand(
            max_loras, MAX_LORA_WAIT_STEPS
        ),
        f"pause, most running first, {max_pause}-step bound": pause_most_running(
            max_loras, max_pause
        ),
        "pause, most running first, no bound": pause_most_running(max_loras, 10**9),
        "pause, round robin": pause_round_robin(max_loras),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--max-pause", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)

    def loop(num_requests: int, seed: int, choose: Choose) -> tuple[float, float]:
        names = [f"z{k}" for k in zipf_names(num_requests, seed)]
        return run_loop(names, choose, args.concurrency, args.output_tokens)

    rows = []
    for name, choose in make_policies(args.max_loras, args.max_pause).items():
        runs = [loop(args.num_requests, seed, choose) for seed in range(args.seeds)]
        per_step, loads = mean(r[0] for r in runs), mean(r[1] for r in runs)
        rows.append([name, f"{per_step:.1f}", f"{per_step / args.concurrency:.2f}", f"{loads:.2f}"])
    check = loop(ENGINE_REQUESTS, 0, held_slots(args.max_loras))[0]
    body = report(args, rows, check)
    title = "Multi-LoRA: rows per step under --max-loras"
    write_section("lora_slot_bound", title, _cmd(argv), body)
    print(body)
    return 0


def report(args: argparse.Namespace, rows: list[list[str]], check: float) -> str:
    share = tail_share(args.max_loras)
    bound = args.max_loras / share
    return (
        f"Model of bench.engine_lora's Zipf({ZIPF_EXPONENT:g}) closed loop over {NUM_ZIPF} "
        f"adapters: {args.num_requests} requests, {args.concurrency} in flight, "
        f"{args.output_tokens} steps each, --max-loras {args.max_loras}, mean of {args.seeds} "
        "seeds.\n\n"
        + markdown_table(
            ["policy", "rows per step", "rows / concurrency", "slot loads per step"], rows
        )
        + "\n\nLetting a sequence pause without holding a slot does not raise the rows a step "
        "runs. A request of an adapter outside the most requested ones is mostly alone in "
        f"flight, and needs a slot for each of its {args.output_tokens} steps whichever steps "
        f"they are: {share:.0%} of the requests are outside the top {args.max_loras}, so even "
        "if each had a slot to itself and the hot adapters took none, a step runs at most about "
        f"{args.max_loras} / {share:.2f} = {bound:.1f} rows, "
        f"{bound / args.concurrency:.2f}x the concurrency. Swapping adapters per step only "
        "moves the wait around, at the price of more slot loads. "
        "Nor does giving a free slot to the adapter with the most sequences waiting (S-LoRA's "
        "demand order; the second row, against the first): in this loop nearly every adapter "
        "waiting for a slot has one sequence waiting, so the order is the queue's but for ties, "
        "and the engine keeps the queue order. "
        f"Check of the model: on bench.engine_lora's own draw ({ENGINE_REQUESTS} requests, "
        f"seed 0) the held-slot rule runs {check:.1f} rows per step, against the engine's "
        f"'running per step' of its Zipf run with --max-loras {args.max_loras} (engine_lora "
        "section).\n"
    )


def _cmd(argv: list[str]) -> str:
    return " ".join(["python -m bench.lora_slot_bound", *argv])


if __name__ == "__main__":
    raise SystemExit(main())
