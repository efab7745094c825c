"""The shared memory arithmetic (DESIGN.md §3.3) against figures computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.contract import catalog, memory
from kvpilot.contract.memory import GIB, ModelFacts

GB = 1e9
# Llama-3.1-8B-like and Llama-3.1-70B-like facts (GQA with 8 KV heads of dim 128).
M7B = ModelFacts(parameters=7_000_000_000, layers=32, kv_heads=8, head_dim=128)
M70B = ModelFacts(parameters=70_000_000_000, layers=80, kv_heads=8, head_dim=128)


@pytest.mark.parametrize(
    ("model", "quantization", "expected_gb"),
    [
        (M7B, "bf16", 14.0),
        (M7B, "int8", 7.0),
        (M7B, "int4", 3.5 * (1 + 4 / 64)),  # 0.5 B/param + a 2-byte scale and zero per 128
        (M70B, "bf16", 140.0),
        (M70B, "int4", 35.0 * (1 + 4 / 64)),
    ],
)
def test_weight_bytes(model: ModelFacts, quantization: str, expected_gb: float) -> None:
    assert memory.weight_bytes(model.parameters, quantization) / GB == pytest.approx(expected_gb)


def test_kv_term_is_the_design_formula_and_scales_linearly() -> None:
    # 2 x 32 layers x 8 kv heads x 128 dim x 2 bytes = 131072 bytes per token
    assert memory.kv_bytes_per_token(M7B, 2) == 131_072
    base = memory.kv_cache_bytes(M7B, 2, tokens=4096, sequences=8)
    assert base == 131_072 * 4096 * 8
    assert memory.kv_cache_bytes(M7B, 2, tokens=8192, sequences=8) == 2 * base
    assert memory.kv_cache_bytes(M7B, 2, tokens=4096, sequences=16) == 2 * base
    assert memory.kv_cache_bytes(M7B, 1, tokens=4096, sequences=8) == base // 2


def test_estimate_splits_by_tensor_parallel_and_describes_the_numbers() -> None:
    one = memory.estimate(M70B, "bf16", 2, 8192, 4, 1, 80 * GIB, 0.9)
    two = memory.estimate(M70B, "bf16", 2, 8192, 4, 2, 80 * GIB, 0.9)
    assert two.weights_bytes == pytest.approx(one.weights_bytes / 2)
    assert two.kv_cache_bytes == pytest.approx(one.kv_cache_bytes / 2)
    assert not one.fits
    text = one.describe()
    assert text.startswith(f"{memory.gib(one.total_bytes):.1f} GiB per GPU (weights ")
    assert text.endswith("> 72.0 GiB usable")


@pytest.mark.parametrize(
    ("budget_gib", "expected_blocks"),
    [(0, 0), (1, 512), (2.5, 1280)],  # 1 GiB / (131072 B/token x 16 tokens) = 512 blocks
)
def test_num_kv_blocks(budget_gib: float, expected_blocks: int) -> None:
    assert memory.num_kv_blocks(M7B, 2, budget_gib * GIB) == expected_blocks


def test_max_concurrency_rounds_to_whole_blocks() -> None:
    # 512 blocks; a 4000-token sequence needs ceil(4000/16) = 250 blocks -> 2 sequences
    assert memory.max_concurrency(M7B, 2, 4000, 1 * GIB) == 2
    assert memory.max_concurrency(M7B, 2, 4000, 1 * GIB, tensor_parallel=2) == 4


# A draft with an eighth of M7B's KV per token (8 layers x 4 KV heads x 128) and 1 B parameters.
DRAFT = ModelFacts(parameters=1_000_000_000, layers=8, kv_heads=4, head_dim=128)


@pytest.mark.parametrize(
    ("tensor_parallel", "kv_per_served_token"),
    [(1, 1 + 1 / 8), (2, 1 / 2 + 1 / 8), (4, 1 / 4 + 1 / 8)],
)
def test_a_draft_is_whole_on_gpu_0_beside_its_share_of_the_served_model(
    tensor_parallel: int, kv_per_served_token: float
) -> None:
    """GPU 0 (rank 0 runs the draft) holds 1/tp of the served model and all of the draft, the
    runtime's own sizing (engine_sizing.size_kv_pool: the draft's share of a rank's block)."""
    alone = memory.estimate(M7B, "bf16", 2, 4096, 8, 1, 80 * GIB, 0.9)
    drafted = memory.estimate(M7B, "bf16", 2, 4096, 8, tensor_parallel, 80 * GIB, 0.9, DRAFT)
    assert drafted.kv_cache_bytes == pytest.approx(alone.kv_cache_bytes * kv_per_served_token)
    assert drafted.weights_bytes == pytest.approx(14 * GB / tensor_parallel + 2 * GB)
    # 1 GiB on GPU 0: blocks of (1/tp + 1/8) x 2 MiB, 250 blocks per 4000-token sequence
    blocks = int(GIB / (kv_per_served_token * memory.kv_bytes_per_token(M7B, 2) * 16))
    expected = blocks // 250
    assert memory.max_concurrency(M7B, 2, 4000, 1 * GIB, tensor_parallel, DRAFT) == expected


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: memory.bytes_per_param("fp4"), "unknown quantization 'fp4'"),
        (lambda: memory.kv_dtype_bytes("int2"), "unknown kvCacheDtype 'int2'"),
        (lambda: ModelFacts(parameters=0, layers=1, kv_heads=1, head_dim=1), "parameters must"),
        (lambda: memory.estimate(M7B, "bf16", 2, 1, 1, 0, GIB, 0.9), "tensor_parallel must"),
        (lambda: memory.estimate(M7B, "bf16", 2, 1, 1, 1, GIB, 1.5), "gpu_memory_utilization"),
        (lambda: memory.num_kv_blocks(M7B, 2, -1), "budget must be >= 0"),
    ],
)
def test_bad_input_names_the_problem(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("kv_cache_dtype", "expected_bytes", "expected_blocks"),
    [("auto", 2, 512), ("bf16", 2, 512), ("fp16", 2, 512), ("fp8", 1, 1024)],
)
def test_kv_dtype_bytes_size_the_pool(
    kv_cache_dtype: str, expected_bytes: int, expected_blocks: int
) -> None:
    """The planner's bytes per KV value (auto: the checkpoint's 16 bits on a GPU); fp8 holds
    twice the blocks of bf16 in the same 1 GiB, so twice the concurrency."""
    kv_bytes = memory.kv_dtype_bytes(kv_cache_dtype)
    assert kv_bytes == expected_bytes
    assert memory.num_kv_blocks(M7B, kv_bytes, 1 * GIB) == expected_blocks
    assert memory.max_concurrency(M7B, kv_bytes, 4000, 1 * GIB) == expected_blocks // 250


TINY_LLAMA = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"


@pytest.mark.parametrize(
    ("changes", "num_slots", "max_rank"),
    [
        ({}, 1, 16),
        ({}, 4, 8),
        ({"head_dim": 64}, 3, 32),  # a query wider than the hidden size, as Qwen3's
        ({"intermediate_size": 1024, "num_key_value_heads": 8}, 8, 4),
    ],
)
def test_lora_slot_bytes_is_what_the_runtime_allocates(
    tmp_path: Path, changes: dict[str, int], num_slots: int, max_rank: int
) -> None:
    import torch

    from kvpilot.runtime.layers.lora import LoraWeights
    from kvpilot.runtime.models.loader import load_model_config

    config = {**json.loads((TINY_LLAMA / "config.json").read_text()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = load_model_config(tmp_path)
    allocated = LoraWeights(cfg, num_slots, max_rank, torch.bfloat16, torch.device("cpu"))
    facts = catalog.facts_from_config(config, parameters=3_819_776)
    assert memory.lora_slot_bytes(facts, num_slots, max_rank) == allocated.num_bytes()


def test_lora_widths_estimated_from_the_parameter_count_are_near_the_real_ones() -> None:
    # Llama-3.1-8B without its widths: 12 h^2 per layer (embeddings counted in) and a 3.5 h MLP
    known = catalog.lookup("hf://meta-llama/Llama-3.1-8B-Instruct")
    assert known is not None
    unknown = ModelFacts(
        parameters=known.parameters,
        layers=known.layers,
        kv_heads=known.kv_heads,
        head_dim=known.head_dim,
    )
    assert memory.lora_dims(known) == (4096, 4096, 1024, 14336)
    estimated = memory.lora_slot_bytes(unknown, 4, 16)
    real = memory.lora_slot_bytes(known, 4, 16)
    assert real <= estimated <= 1.2 * real  # an overestimate, never an underestimate here
    # 4 slots of rank 16 on the 8B: 32 layers x 16 x (7h + 2q + 2kv + 3i) x 2 bytes x 4
    assert real == 4 * 16 * 32 * 2 * (7 * 4096 + 2 * 4096 + 2 * 1024 + 3 * 14336)


def test_lora_slots_count_as_weights_in_the_estimate() -> None:
    base = memory.estimate(M7B, "bf16", 2, 4096, 8, 1, 80 * GIB, 0.9)
    with_slots = memory.estimate(M7B, "bf16", 2, 4096, 8, 1, 80 * GIB, 0.9, lora_bytes=GIB)
    assert with_slots.weights_bytes == base.weights_bytes + GIB
    assert with_slots.overhead_bytes > base.overhead_bytes  # activations scale with the weights
