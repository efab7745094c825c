"""Shared pieces of the engine benchmarks: the tiny-llama model, workloads, timing helpers."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.engine import Engine, RequestOutput
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.models.tokenizer_files import Tokenizer

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
    met = value >= target
    return (
        f"{_agreeing_figure(value, target)}x (target >= {target}x: {'met' if met else 'not met'})"
    )


def _agreeing_figure(value: float, target: float) -> str:
    """`value` with as many decimals as it takes for the figure to agree with the verdict
    beside it: 0.598 against a 0.6 goal reads 0.598, not a 'not met' 0.60."""
    met = value >= target
    for digits in range(2, 7):
        text = f"{value:.{digits}f}"
        if (float(text) >= target) == met:
            return text
    return repr(value)


def threads_note() -> str:
    device = (
        "CUDA" if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} torch thread(s)"
    )
    return f"Device: {device}."


# A Llama big enough that the matmuls, not Python, set the speed (~245 M parameters with the
# tied 4,096-token vocabulary of tiny-llama, whose tokenizer it reuses): the engine-speed
# benchmarks compare compute-bound throughput on it. Random weights, made once per machine.
COMPUTE_BOUND_SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


def compute_bound_llama(cache_dir: Path | None = None) -> Path:
    """A random-weight Llama (COMPUTE_BOUND_SHAPE, bf16 safetensors, tiny-llama's tokenizer) in
    a cache outside the clone, keyed by its shape; made with transformers the first time."""
    import hashlib
    import json
    import os
    import shutil

    root = cache_dir or Path(os.environ.get("KVPILOT_CACHE_DIR", Path.home() / ".cache/kvpilot"))
    key = hashlib.sha256(json.dumps(COMPUTE_BOUND_SHAPE, sort_keys=True).encode()).hexdigest()
    path = root / "models" / f"compute-bound-llama-{key[:12]}"
    if (path / ".complete").exists():
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    base = json.loads((MODEL / "config.json").read_text())
    config = LlamaConfig(**{**base, **COMPUTE_BOUND_SHAPE, "max_position_embeddings": 4096})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers wraps .to() oddly
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(MODEL / name, path / name)
    (path / ".complete").touch()
    return path
