"""Reading PEFT adapters and what is refused, with the field or module named; the adapter slots'
bookkeeping (pure logic, table-driven)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from bench.reference.models import TINY_LLAMA
from kvpilot.runtime.engine.lora_slots import LoraSlots
from kvpilot.runtime.models.loader import load_model_config
from kvpilot.runtime.models.lora_files import LoraError, load_adapter

CFG = load_model_config(TINY_LLAMA)  # hidden 256, 8 heads x 32, 2 KV heads, MLP 688
PREFIX = "base_model.model.model.layers"


def write_adapter(
    path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None
) -> str:
    rank = config.get("r", 4)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 8, **config}))
    if tensors is None:
        tensors = {
            f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.ones(rank, 256),
            f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.ones(256, rank),
        }
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def test_weights_are_read_with_the_scaling_folded_into_b(tmp_path: Path) -> None:
    plain = load_adapter(write_adapter(tmp_path / "a", {"r": 4}), CFG, max_rank=16)
    a, b = plain.weights[(0, "q_proj")]
    assert (plain.rank, plain.target_modules) == (4, ["q_proj"])
    assert float(a[0, 0]) == 1 and float(b[0, 0]) == 8 / 4  # lora_alpha / r
    rs = load_adapter(write_adapter(tmp_path / "b", {"r": 4, "use_rslora": True}), CFG, 16)
    assert float(rs.weights[(0, "q_proj")][1][0, 0]) == 8 / 2  # lora_alpha / sqrt(r)


MLP_A = f"{PREFIX}.1.mlp.down_proj.lora_A.weight"
MLP_B = f"{PREFIX}.1.mlp.down_proj.lora_B.weight"


@pytest.mark.parametrize(
    ("config", "tensors", "match"),
    [
        ({"r": 32}, None, r"rank r=32 is above --max-lora-rank 16"),
        ({"use_dora": True}, None, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({"bias": "lora_only"}, None, "field bias"),
        ({"rank_pattern": {"q_proj": 8}}, None, "rank_pattern"),
        ({"peft_type": "IA3"}, None, "peft_type 'IA3'"),
        ({"r": 0}, None, "r must be a positive integer"),
        (
            {},
            {f"{PREFIX}.0.self_attn.qkv.lora_A.weight": torch.ones(4, 256)},
            "targets module 'qkv', which the model lacks",
        ),
        (
            {},
            {"base_model.model.lm_head.lora_A.weight": torch.ones(4, 256)},
            "not a LoRA A/B weight of a decoder layer",
        ),
        ({}, {f"{PREFIX}.9.mlp.down_proj.lora_A.weight": torch.ones(4, 688)}, "4 layers"),
        (
            {},
            {MLP_A: torch.ones(4, 1024), MLP_B: torch.ones(256, 4)},
            r"layers.1.down_proj: lora_A \[4, 1024\] and lora_B \[256, 4\] do not fit the base "
            r"model, which needs \[4, 688\] and \[256, 4\]",
        ),
        ({}, {MLP_A: torch.ones(4, 688)}, "not both lora_A and lora_B"),
    ],
)
def test_what_cannot_run_is_refused_naming_the_cause(
    tmp_path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor] | None, match: str
) -> None:
    with pytest.raises(LoraError, match=match):
        load_adapter(write_adapter(tmp_path, config, tensors), CFG, max_rank=16)


def test_a_directory_without_the_files_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LoraError, match=r"no adapter_config\.json"):
        load_adapter(str(tmp_path), CFG, 16)
    (tmp_path / "adapter_config.json").write_text('{"r": 4}')
    with pytest.raises(LoraError, match=r"no adapter_model\.safetensors"):
        load_adapter(str(tmp_path), CFG, 16)


# (operations, expected results): ("acquire", id) -> (slot, needs loading); ("release", slot)
SLOT_CASES = [
    ([("acquire", 7), ("acquire", 7)], [(0, True), (0, False)]),
    ([("acquire", 7), ("acquire", 8)], [(0, True), (1, True)]),
    # Both slots busy: a third adapter cannot come in until one is released.
    ([("acquire", 7), ("acquire", 8), ("can", 9)], [(0, True), (1, True), False]),
    # Released, the least recently used free slot is taken; the other adapter stays resident.
    (
        [("acquire", 7), ("acquire", 8), ("release", 0), ("acquire", 9), ("can", 8)],
        [(0, True), (1, True), None, (0, True), True],
    ),
    # Released but not evicted: acquiring it again needs no load.
    ([("acquire", 7), ("release", 0), ("acquire", 7)], [(0, True), None, (0, False)]),
    # Both free: the one used longest ago goes first.
    (
        [("acquire", 7), ("acquire", 8), ("release", 1), ("release", 0), ("acquire", 9)],
        [(0, True), (1, True), None, None, (0, True)],
    ),
]


@pytest.mark.parametrize(("operations", "expected"), SLOT_CASES)
def test_slots_are_shared_by_an_adapter_and_swapped_least_recently_used(
    operations: list[tuple[str, int]], expected: list[Any]
) -> None:
    slots = LoraSlots(2)
    results: list[Any] = []
    for operation, value in operations:
        if operation == "acquire":
            results.append(slots.acquire(value))
        elif operation == "release":
            slots.release(value)
            results.append(None)
        else:
            results.append(slots.can_acquire(value))
    assert results == expected


def test_a_release_without_a_user_is_an_error() -> None:
    with pytest.raises(ValueError, match="no user to release"):
        LoraSlots(1).release(0)
