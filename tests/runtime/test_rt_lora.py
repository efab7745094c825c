"""Multi-LoRA in the engine against transformers + peft: four random adapters of different ranks
and targets and the base model in one batch, greedy tokens and logprobs per adapter; int8 base
weights; --max-loras fewer than the adapters asked for; the prefix cache keyed by adapter;
tensor parallelism (2 CPU ranks) against one process and against peft."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.reference.lora import MIXED_ADAPTERS, load_base, make_adapter, reference_logprobs
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # loads a model

NUM_TOKENS = 12
PROMPTS = [[1, 450, 3681, 310, 278, 3186], [1, 9, 33, 17, 400, 12, 88, 1001, 7, 7, 7] * 3]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """name -> (adapter directory, its transformers + peft reference model)."""
    base = load_base()
    root = tmp_path_factory.mktemp("adapters")
    return {
        spec.name: (root / spec.name, make_adapter(base, spec, root / spec.name))
        for spec in MIXED_ADAPTERS
    }


def run_mixed(
    engine: Engine, names: list[str | None]
) -> dict[str, tuple[list[int], list[dict[int, float]]]]:
    """Every (prompt, adapter) pair added before the first step, stepped to the end; request id
    -> (tokens, top logprobs per token)."""
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, logprobs=3, ignore_eos=True)
    for name in names:
        lora = None if name is None else engine.lora_request(name)
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(prompt, params, f"{name}/{index}", lora)
    results: dict[str, tuple[list[int], list[dict[int, float]]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, logprobs = results.setdefault(out.request_id, ([], []))
            tokens += out.new_token_ids
            logprobs += out.logprobs or []
    return results


def check_against_reference(
    results: dict[str, tuple[list[int], list[dict[int, float]]]],
    references: dict[str | None, Any],
    atol: float,
) -> None:
    """Each output's top logprobs within `atol` of the reference's, and each token the
    reference's greedy choice (up to a near tie within `atol`: 0 would be exact)."""
    for name, model in references.items():
        for index, prompt in enumerate(PROMPTS):
            tokens, logprobs = results[f"{name}/{index}"]
            want = reference_logprobs(model, prompt, tokens)  # [NUM_TOKENS, vocab]
            assert len(tokens) == NUM_TOKENS
            for step, (token, top) in enumerate(zip(tokens, logprobs, strict=True)):
                where = f"adapter {name}, prompt {index}, token {step}"
                assert float(want[step, token]) >= float(want[step].max()) - atol, where
                for candidate, value in top.items():
                    assert abs(value - float(want[step, candidate])) < atol, where


def load_all(engine: Engine, adapters: dict[str, tuple[Path, Any]]) -> None:
    for name, (path, _) in adapters.items():
        engine.load_lora(name, str(path))


def test_mixed_batch_of_four_adapters_and_base_matches_peft(
    make_engine: Callable[..., Engine], adapters: dict[str, tuple[Path, Any]]
) -> None:
    engine = make_engine(enable_lora=True, max_loras=4, max_lora_rank=16)
    load_all(engine, adapters)
    names: list[str | None] = [*adapters, None]
    engine.step()  # nothing yet; then everything arrives at once
    results = run_mixed_with_check(engine, names)
    references: dict[str | None, Any] = {name: model for name, (_, model) in adapters.items()}
    references[None] = load_base()
    check_against_reference(results, references, atol=1e-4)
    # The adapters change the output: a test of the base alone would not pass for them.
    assert len({tuple(results[f"{name}/1"][0]) for name in names}) == len(names)


def run_mixed_with_check(engine: Engine, names: list[str | None]) -> dict[str, Any]:
    """run_mixed, checking that the first step really ran every adapter together."""
    original = engine.step
    seen: list[tuple[str, ...]] = []

    def step() -> Any:
        out = original()
        seen.append(engine.stats().running_lora_adapters)
        return out

    engine.step = step  # type: ignore[method-assign]
    results = run_mixed(engine, names)
    assert seen[0] == tuple(sorted(n for n in names if n is not None))
    return results


def test_int8_base_with_adapters_matches_peft_on_the_dequantised_weights(
    make_engine: Callable[..., Engine], adapters: dict[str, tuple[Path, Any]]
) -> None:
    """The fair reference for an int8 base: transformers + peft on the very weights the int8
    kernel multiplies by (dequantised), so only the kernel's rounding of activations differs."""
    engine = make_engine(enable_lora=True, max_loras=4, quantization="int8", int8_kernel="w8a16")
    load_all(engine, adapters)
    dequantised = dequantised_base(engine)
    references: dict[str | None, Any] = {None: dequantised}
    for name, (path, _) in adapters.items():
        from peft import PeftModel

        references[name] = PeftModel.from_pretrained(copy.deepcopy(dequantised), path).eval()
    results = run_mixed(engine, [*adapters, None])
    check_against_reference(results, references, atol=0.05)


def dequantised_base(engine: Engine) -> Any:
    """tiny-llama in transformers with each linear layer's weights as the engine's int8 stores
    them (the fused q/k/v and gate/up split back)."""
    model = load_base()
    cfg = engine.model_config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    ours = engine.runner.model
    with torch.no_grad():
        for layer, hf in zip(ours.layers, model.model.layers, strict=True):
            wq, wk, wv = layer.qkv.weight.dequantize(torch.float32).split([q, kv, kv])
            gate, up = layer.gate_up.weight.dequantize(torch.float32).chunk(2)
            for module, weight in [
                (hf.self_attn.q_proj, wq), (hf.self_attn.k_proj, wk), (hf.self_attn.v_proj, wv),
                (hf.self_attn.o_proj, layer.o.weight.dequantize(torch.float32)),
                (hf.mlp.gate_proj, gate), (hf.mlp.up_proj, up),
                (hf.mlp.down_proj, layer.down.weight.dequantize(torch.float32)),
            ]:  # fmt: skip
                module.weight.copy_(weight)
        embed = ours.embed.dequantize(torch.float32)
        model.model.embed_tokens.weight.copy_(embed)
    return model


def test_fewer_slots_than_adapters_runs_every_request_within_the_slots(
    make_engine: Callable[..., Engine], adapters: dict[str, tuple[Path, Any]]
) -> None:
    """--max-loras 2 and four adapters asked for at once: no step runs more than two adapters,
    the others wait for a slot (the base model does not), and every output is right."""
    engine = make_engine(enable_lora=True, max_loras=2, max_lora_rank=16)
    load_all(engine, adapters)
    original, most = engine.step, 0

    def step() -> Any:
        nonlocal most
        out = original()
        most = max(most, len(engine.stats().running_lora_adapters))
        return out

    engine.step = step  # type: ignore[method-assign]
    results = run_mixed(engine, [*adapters, None])
    assert most == 2
    references: dict[str | None, Any] = {name: model for name, (_, model) in adapters.items()}
    check_against_reference(results, references, atol=2e-4)


def test_tensor_parallel_adapters_match_one_process_and_peft(
    make_engine: Callable[..., Engine], adapters: dict[str, tuple[Path, Any]]
) -> None:
    """TP 2: each rank holds its shard of every adapter (B split for q/k/v/gate/up, A for o and
    down, whose partial deltas ride the base's all-reduce). Two slots for four adapters, so
    slots are rewritten on every rank mid-run. The same greedy tokens as one process, and peft's
    logprobs."""
    names: list[str | None] = [*adapters, None]
    one = make_engine(enable_lora=True, max_loras=2, enable_prefix_caching=False)
    load_all(one, adapters)
    expected = run_mixed(one, names)
    tp2 = make_engine(
        enable_lora=True, max_loras=2, enable_prefix_caching=False, tensor_parallel_size=2
    )
    try:
        load_all(tp2, adapters)
        results = run_mixed(tp2, names)
        assert tp2.scheduler.lora_slots is not None
        assert tp2.scheduler.lora_slots.num_evictions > 0  # slots rewritten on both ranks
    finally:
        tp2.shutdown()
    assert {k: tokens for k, (tokens, _) in results.items()} == {
        k: tokens for k, (tokens, _) in expected.items()
    }
    references: dict[str | None, Any] = {name: model for name, (_, model) in adapters.items()}
    references[None] = load_base()
    check_against_reference(results, references, atol=2e-4)


def test_prefix_cache_is_keyed_by_adapter(
    make_engine: Callable[..., Engine], adapters: dict[str, tuple[Path, Any]]
) -> None:
    """A prompt computed under one adapter is served from the cache to that adapter again, never
    to another adapter or to the base model (their KV differs)."""
    engine = make_engine(enable_lora=True, max_loras=2)
    load_all(engine, adapters)
    prompt = PROMPTS[1]  # 33 tokens: two full blocks
    params = SamplingParams(max_tokens=2, temperature=0)

    def cached_tokens(name: str | None, request_id: str) -> int:
        lora = None if name is None else engine.lora_request(name)
        engine.add_request(prompt, params, request_id, lora)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    return out.num_cached_tokens
        raise AssertionError("request did not finish")

    assert cached_tokens("qv8", "a1") == 0
    assert cached_tokens("mlp4", "b1") == 0  # not qv8's
    assert cached_tokens(None, "base1") == 0  # not the adapters'
    assert cached_tokens("qv8", "a2") == 32
    assert cached_tokens("mlp4", "b2") == 32
    assert cached_tokens(None, "base2") == 32
    # Unloaded and loaded again (perhaps other weights under the same name): a new key.
    engine.unload_lora("qv8")
    engine.load_lora("qv8", str(adapters["qv8"][0]))
    assert cached_tokens("qv8", "a3") == 0
