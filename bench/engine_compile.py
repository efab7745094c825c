"""Engine: torch.compile of the decoder layers on CPU, tried (issue 19 item 5).

    .venv/bin/python -m bench.engine_compile [--models tiny,compute] [--rounds 2] [--steps 20]

64 sequences decoding (prompts of 128 random token ids, greedy, `--attention-backend paged`), one
torch thread: the decode step with the layers as they are, against the same engine with each
layer's dense parts compiled by `torch.compile(dynamic=True)` (inductor's C++ backend): before
attention (RMSNorm, the qkv matmul, the rotary embedding) and after it (o_proj and the residual,
RMSNorm, gate/up, SiLU x up, down and the residual). Attention, a custom op, runs between the
compiled regions. The two alternate, best of --rounds; the compile itself is outside the timing.
Dense weights only (no quantisation), no tensor parallelism, speed only (the outputs are not
compared): a trial, not a runtime option.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the torch convention

from bench.engine_common import MODEL, compute_bound_llama, setup_threads, threads_note
from bench.engine_step_profile import decoding_engine
from bench.report import command_line, markdown_table, write_section
from kvpilot.runtime.layers.rotary import apply_rotary
from kvpilot.runtime.models import llama

NUM_SEQS, PROMPT_LEN, WARM_STEPS = 64, 128, 5


def before_attention(
    x: torch.Tensor, norm: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int, head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    qk, v = F.linear(llama.rms_norm(x, norm, eps), qkv).split(
        [(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], dim=-1
    )
    q, k = apply_rotary(qk.unflatten(-1, (num_heads + num_kv_heads, head_dim)), cos, sin).split(
        [num_heads, num_kv_heads], dim=1
    )
    return q, k, v.unflatten(-1, (num_kv_heads, head_dim))


def after_attention(
    x: torch.Tensor, attn: torch.Tensor, o: torch.Tensor, norm: torch.Tensor,
    gate_up: torch.Tensor, down: torch.Tensor, eps: float,
) -> torch.Tensor:  # fmt: skip
    x = x + F.linear(attn.flatten(1), o)
    gate, up = F.linear(llama.rms_norm(x, norm, eps), gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down)


def compiled_layer_call() -> Callable[..., torch.Tensor]:
    before = torch.compile(before_attention, dynamic=True)
    after = torch.compile(after_attention, dynamic=True)

    def call(
        layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
        meta: Any, output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        cfg = layer.cfg
        q, k, v = before(
            x, layer.input_norm, layer.qkv.weight.weight, cos, sin, cfg.rms_norm_eps,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        )  # fmt: skip
        attn = llama.paged_attention(q, k, v, cache[0], cache[1], meta, cfg.head_dim**-0.5)
        if output_rows is not None:
            x, attn = x[output_rows], attn[output_rows]
        return after(
            x, attn, layer.o.weight.weight, layer.post_attn_norm, layer.gate_up.weight.weight,
            layer.down.weight.weight, cfg.rms_norm_eps,
        )  # fmt: skip

    return call


def step_ms(model: Any, num_steps: int) -> float:
    engine = decoding_engine(model, NUM_SEQS, num_steps + WARM_STEPS, PROMPT_LEN, "paged")
    for _ in range(WARM_STEPS):  # the compile happens here
        engine.step()
    started = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    return 1000 * (time.perf_counter() - started) / num_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="tiny,compute")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    setup_threads()
    eager_call, compiled_call = llama.DecoderLayer.__call__, compiled_layer_call()
    calls = {"eager": eager_call, "compiled": compiled_call}
    table = []
    for name in args.models.split(","):
        model = MODEL if name == "tiny" else compute_bound_llama()
        best = dict.fromkeys(calls, float("inf"))
        try:
            for round_index in range(args.rounds):
                order = list(calls) if round_index % 2 == 0 else list(reversed(calls))
                for mode in order:
                    llama.DecoderLayer.__call__ = calls[mode]  # type: ignore[method-assign]
                    best[mode] = min(best[mode], step_ms(model, args.steps))
                    print(f"{name} {mode}: {best[mode]:.2f} ms/step", flush=True)
        finally:
            llama.DecoderLayer.__call__ = eager_call  # type: ignore[method-assign]
        label = "tiny-llama (4 M)" if name == "tiny" else "compute-bound Llama (245 M)"
        ratio = best["eager"] / best["compiled"]
        table.append([label, f"{best['eager']:.2f}", f"{best['compiled']:.2f}", f"{ratio:.2f}x"])
    header = ["model", "eager ms/step", "compiled ms/step", "compiled speed-up"]
    body = (
        f"{NUM_SEQS} sequences decoding, prompts of {PROMPT_LEN}, {args.steps} steps timed, best "
        f"of {args.rounds} rounds, alternating. {threads_note()}\n\n"
        + markdown_table(header, table)
        + "\n\nNot kept in the runtime unless it measurably helps: the matmuls are the same "
        "oneDNN/MKL calls either way, and what inductor fuses (the norms, SiLU x up, the "
        "rotary embedding) is a small share of a step."
    )
    command = command_line("bench.engine_compile", argv)
    write_section(
        "engine_compile", "Engine: torch.compile of the decoder layers (trial)",
        command, body,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
