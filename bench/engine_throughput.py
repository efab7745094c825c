"""Mixed-workload output throughput: kvpilot engine vs transformers, same model, one run.

    .venv/bin/python -m bench.engine_throughput [--num-requests 128] [--max-output 256]

Baselines: `generate()` one request at a time; static batches of 16 with left padding (a batch
runs until its longest request is done; only each request's own tokens count); and transformers'
continuous batching `generate_batch`, where it is available, on the same requests.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from typing import Any

import torch

from bench.engine_common import (
    MODEL,
    Request,
    clock,
    drain,
    fmt_ratio,
    greedy,
    make_engine,
    mixed_workload,
    setup_threads,
    threads_note,
)
from bench.report import markdown_table, write_section
from kvpilot.runtime.engine import machine_files
from kvpilot.runtime.models.loader import load_model_config, resolve_dtype


def run_kvpilot(requests: list[Request]) -> float:
    engine = make_engine(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=1024)
    start = clock()
    for index, req in enumerate(requests):
        engine.add_request(req.prompt, greedy(req.num_output_tokens), str(index))
    drain(engine)
    return clock() - start


def compute_dtype() -> torch.dtype:
    checkpoint = load_model_config(MODEL).torch_dtype
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return resolve_dtype("auto", checkpoint, device, machine_files.cpu_supports_bf16())


def hf_model() -> Any:
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = compute_dtype()  # the engine's `auto` choice: both sides compute alike
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype)
    return model.to(device).eval()  # type: ignore[arg-type]


@torch.no_grad()
def run_hf_sequential(model: Any, requests: list[Request]) -> float:
    start = clock()
    for req in requests:
        ids = torch.tensor([req.prompt], device=model.device)
        n = req.num_output_tokens
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return clock() - start


@torch.no_grad()
def run_hf_static(model: Any, requests: list[Request], batch_size: int = 16) -> float:
    start = clock()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, req in enumerate(batch):  # left padding, as decoder-only batching needs
            ids[row, width - len(req.prompt) :] = torch.tensor(req.prompt)
            mask[row, width - len(req.prompt) :] = 1
        n = max(r.num_output_tokens for r in batch)
        model.generate(
            ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return clock() - start


@torch.no_grad()
def run_hf_continuous(model: Any, requests: list[Request]) -> float | str:
    """generate_batch takes one generation config, so requests are grouped by output length."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if not hasattr(model, "generate_batch"):
        return "not available in this transformers version"
    start = clock()
    lengths = sorted({r.num_output_tokens for r in requests})
    config = GenerationConfig(
        max_new_tokens=max(lengths), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    # A bounded paged cache (64k tokens); its CPU default sizes the cache from host memory.
    paging = ContinuousBatchingConfig(num_blocks=4096, max_batch_tokens=2048, **page_of(16))
    model.generate_batch(
        [r.prompt for r in requests],
        generation_config=config,
        continuous_batching_config=paging,
        warmup=False,
    )
    return clock() - start


def page_of(tokens: int) -> dict[str, Any]:
    """The paged cache's page size under the name this transformers takes: `page_size` since
    5.2x, `block_size` before (5.17, on the lent GPU machine, refused `page_size`)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    names = inspect.signature(ContinuousBatchingConfig).parameters
    return {"page_size" if "page_size" in names else "block_size": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-output", type=int, default=256)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    setup_threads()
    requests = mixed_workload(args.num_requests, (32, 512), (16, args.max_output))
    useful = sum(r.num_output_tokens for r in requests)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    ours = useful / run_kvpilot(requests)
    model = hf_model()
    sequential = useful / run_hf_sequential(model, requests)
    static = useful / run_hf_static(model, requests)
    continuous_time = run_hf_continuous(model, requests)
    rows: list[list[object]] = [
        ["kvpilot engine", f"{ours:.1f}", "-"],
        [
            "transformers generate(), one at a time",
            f"{sequential:.1f}",
            fmt_ratio(ours / sequential, 10),
        ],
        ["transformers static batches of 16", f"{static:.1f}", fmt_ratio(ours / static, 2)],
    ]
    if isinstance(continuous_time, float):
        # generate_batch takes one max_new_tokens for all: compare on that uniform job.
        longest = max(r.num_output_tokens for r in requests)
        uniform = [Request(r.prompt, longest) for r in requests]
        produced = len(uniform) * longest
        ours_uniform = produced / run_kvpilot(uniform)
        cb = produced / continuous_time
        rows.append(
            [
                f"transformers generate_batch (every request to {longest} tokens)",
                f"{cb:.1f}",
                f"{fmt_ratio(ours_uniform / cb, 1.5)}; kvpilot {ours_uniform:.1f} tok/s there",
            ]
        )
    body = (
        threads_note()
        + " "
        + (
            f"Workload: {len(requests)} requests, prompts 32-512 tokens, "
            f"outputs 16-{args.max_output} "
            f"tokens ({useful} output tokens), greedy, EOS ignored; model models/tiny-llama "
            f"({str(compute_dtype()).removeprefix('torch.')} on both sides, kvpilot's "
            "`--dtype auto` here).\n\n"
            + markdown_table(["system", "output tokens/s", "kvpilot speed-up"], rows)
            + f"\n\nThe workload has {prompt_tokens} prompt tokens, "
            f"{prompt_tokens / useful:.1f}x its output tokens. On a CPU, time per token is\n"
            "compute, and prefill compute is the same for every system, so it bounds what\n"
            "batching can gain over one-at-a-time generate()."
        )
    )
    command = " ".join(["python -m bench.engine_throughput", *argv])
    write_section("engine_throughput", "Engine: mixed-workload throughput", command.strip(), body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
