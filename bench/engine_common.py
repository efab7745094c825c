"""Shared pieces of the engine benchmarks: the tiny-llama model, workloads, timing helpers."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine import Engine, RequestOutput
from kvpilot.runtime.sampling import SamplingParams
from kvpilot.runtime.tokenizer import Tokenizer

MODEL = Path(__file__).resolve().parent.parent / "models" / "tiny-llama"


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    num_output_tokens: int


def corpus_ids() -> list[int]:
    """Token ids of text every machine has, long enough to cut 512-token prompts from."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return Tokenizer(MODEL).encode(text)


def mixed_workload(
    num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int = 0
) -> list[Request]:
    ids = corpus_ids()
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        length = rng.randint(*prompt_range)
        start = rng.randrange(0, len(ids) - length)
        requests.append(Request(ids[start : start + length], rng.randint(*output_range)))
    return requests


def make_engine(**kwargs: Any) -> Engine:
    kwargs.setdefault("device", "auto")
    return Engine(EngineConfig(model=str(MODEL), **kwargs))


def greedy(num_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)


def clock() -> float:
    """Seconds for timing. On CPU the process's own CPU time: the machines are shared, and wall
    time would mostly measure what else runs. With one torch thread it is the compute time."""
    if torch.cuda.is_available():
        return time.perf_counter()
    return time.process_time()


def drain(engine: Engine) -> list[tuple[float, RequestOutput]]:
    """Step until idle; every output with the time it came out."""
    timed = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = clock()
        timed += [(now, out) for out in outputs]
    return timed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def median(values: list[float]) -> float:
    return statistics.median(values)


def setup_threads() -> None:
    torch.manual_seed(0)
    if not torch.cuda.is_available():
        # One thread: on a shared, busy CPU a two-thread parallel region stalls whenever either
        # thread is descheduled, which makes step times (and every ratio) erratic.
        torch.set_num_threads(1)


def fmt_ratio(value: float, target: float) -> str:
    return f"{value:.2f}x (target >= {target}x: {'met' if value >= target else 'not met'})"


def threads_note() -> str:
    device = (
        "CUDA" if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} torch thread(s)"
    )
    return f"Device: {device}."
