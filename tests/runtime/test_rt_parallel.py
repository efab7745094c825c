"""Tensor-parallel sharding rules: which tensors split along which dimension, when a
tensor_parallel_size is refused, and the step plan rank 0 sends to the other ranks."""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvpilot.runtime.engine.model_runner import PrefillPlan, plan_step
from kvpilot.runtime.engine.parallel import (
    TPGroup,
    check_tensor_parallel,
    lora_shard_dim,
    shard_config,
    shard_dim,
)
from kvpilot.runtime.engine.scheduler import ScheduledSequence
from kvpilot.runtime.engine.sequence import Sequence
from kvpilot.runtime.models.loader import ModelConfig

LLAMA = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=688,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    has_qkv_bias=False,
    torch_dtype="bfloat16",
)


@pytest.mark.parametrize(
    ("name", "dim"),
    [
        ("model.layers.0.self_attn.q_proj.weight", 0),
        ("model.layers.0.self_attn.k_proj.weight", 0),
        ("model.layers.3.self_attn.v_proj.weight", 0),
        ("model.layers.0.self_attn.q_proj.bias", 0),  # Qwen2: the bias follows its outputs
        ("model.layers.0.mlp.gate_proj.weight", 0),
        ("model.layers.0.mlp.up_proj.weight", 0),
        ("model.layers.0.self_attn.o_proj.weight", 1),
        ("model.layers.0.mlp.down_proj.weight", 1),
        ("model.layers.0.input_layernorm.weight", None),
        ("model.layers.0.post_attention_layernorm.weight", None),
        ("model.embed_tokens.weight", None),
        ("lm_head.weight", None),
        ("model.norm.weight", None),
        # pre-quantised: compressed-tensors keeps outputs first, GPTQ and AWQ inputs first
        ("model.layers.0.self_attn.q_proj.weight_packed", 0),
        ("model.layers.0.self_attn.q_proj.weight_scale", 0),
        ("model.layers.0.mlp.up_proj.weight_zero_point", 0),
        ("model.layers.0.mlp.down_proj.weight_packed", 1),
        ("model.layers.0.self_attn.o_proj.weight_scale", 1),
        ("model.layers.0.mlp.gate_proj.qweight", 1),
        ("model.layers.0.mlp.gate_proj.qzeros", 1),
        ("model.layers.0.self_attn.k_proj.scales", 1),
        ("model.layers.0.self_attn.k_proj.g_idx", None),
        ("model.layers.0.mlp.down_proj.qweight", 0),
        ("model.layers.0.mlp.down_proj.scales", 0),
        ("model.layers.0.self_attn.o_proj.g_idx", 0),
        ("lm_head.qweight", None),  # replicated, quantised or not
        ("model.layers.0.self_attn.q_proj.input_scale", None),
    ],
)
def test_shard_dim(name: str, dim: int | None) -> None:
    assert shard_dim(name) == dim


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("model.layers.0.self_attn.o_proj.weight_scale", (256, 1)),  # per channel: outputs'
        ("model.layers.0.mlp.down_proj.scales", (1, 256)),  # GPTQ group -1: one per row
        ("model.layers.0.self_attn.q_proj.weight_scale", (1,)),  # fp8 per tensor
        ("model.layers.0.self_attn.q_proj.weight_scale", ()),
    ],
)
def test_a_scale_shared_along_the_split_is_kept_whole(name: str, shape: tuple[int, ...]) -> None:
    scale = torch.rand(shape)
    assert TPGroup(1, 2).shard(name, scale) is scale


def test_row_parallel_g_idx_counts_the_ranks_own_groups() -> None:
    """A rank's share of a row-parallel input is whole groups, numbered from its first."""
    g_idx = torch.arange(512, dtype=torch.int32) // 128
    name = "model.layers.0.mlp.down_proj.g_idx"
    assert torch.equal(TPGroup(1, 2).shard(name, g_idx), g_idx[:256])


@pytest.mark.parametrize(
    ("module", "expected"),
    [("self_attn.q_proj", [128, 256]), ("mlp.down_proj", [256, 344]), ("norm", [256, 688])],
)
def test_compressed_tensors_weight_shape_is_the_ranks_share(
    module: str, expected: list[int]
) -> None:
    shape = torch.tensor([256, 688] if module != "self_attn.q_proj" else [256, 256])
    shared = TPGroup(0, 2).shard(f"model.layers.0.{module}.weight_shape", shape)
    assert shared.tolist() == expected


@pytest.mark.parametrize(
    ("tp", "changes", "message"),
    [
        (1, {}, None),
        (2, {}, None),
        (4, {"num_kv_heads": 4}, None),
        (3, {}, "tensor_parallel_size 3 must divide num_attention_heads and num_key_value_heads"),
        (4, {}, "tensor_parallel_size 4 must divide num_key_value_heads; the model has"),
        (2, {"intermediate_size": 687}, "must divide intermediate_size"),
    ],
)
def test_check_tensor_parallel(tp: int, changes: dict[str, Any], message: str | None) -> None:
    cfg = replace(LLAMA, **changes)
    if message is None:
        check_tensor_parallel(cfg, tp)
        return
    with pytest.raises(ValueError, match=message) as error:
        check_tensor_parallel(cfg, tp)
    assert f"num_attention_heads {cfg.num_heads}, num_key_value_heads" in str(error.value)


def test_shard_config_divides_heads_and_mlp_only() -> None:
    rank_cfg = shard_config(LLAMA, 2)
    assert (rank_cfg.num_heads, rank_cfg.num_kv_heads, rank_cfg.intermediate_size) == (4, 1, 344)
    assert (rank_cfg.hidden_size, rank_cfg.head_dim, rank_cfg.vocab_size) == (256, 32, 4096)


@pytest.mark.parametrize(
    ("name", "rank", "rows", "cols"),
    [
        ("model.layers.0.self_attn.k_proj.weight", 0, slice(0, 2), slice(0, 6)),
        ("model.layers.0.self_attn.k_proj.weight", 1, slice(2, 4), slice(0, 6)),
        ("model.layers.0.self_attn.o_proj.weight", 0, slice(0, 4), slice(0, 3)),
        ("model.layers.0.self_attn.o_proj.weight", 1, slice(0, 4), slice(3, 6)),
        ("model.norm.weight", 1, slice(0, 4), slice(0, 6)),
    ],
)
def test_shard_takes_this_ranks_slice(name: str, rank: int, rows: slice, cols: slice) -> None:
    full = torch.arange(24.0).view(4, 6)  # [out, in]
    shard = TPGroup(rank, 2).shard(name, full)
    assert torch.equal(shard, full[rows, cols])
    assert shard.is_contiguous()


def test_shard_refuses_a_tensor_that_does_not_split() -> None:
    with pytest.raises(ValueError, match="does not split into tensor_parallel_size 2"):
        TPGroup(0, 2).shard("model.layers.0.mlp.up_proj.weight", torch.zeros(5, 4))


def test_single_rank_all_reduce_is_identity() -> None:
    x = torch.ones(3)
    assert TPGroup().all_reduce(x) is x


def test_plan_step_is_what_every_rank_needs_in_plain_ints() -> None:
    """Decodes first (by context length), then prefill chunks; sample rows in batch order."""
    prefill = Sequence("p", list(range(100, 120)), block_table=[7, 3])  # 20 tokens, 4 computed
    prefill.num_computed_tokens = 4
    decode = Sequence("d", [5, 6, 7], block_table=[2])  # 2 computed, its 3rd token is new
    decode.num_computed_tokens = 2
    plan = plan_step([ScheduledSequence(prefill, 16), ScheduledSequence(decode, 1)])
    assert plan.input_ids == [7, *range(104, 120)]
    assert plan.positions == [2, *range(4, 20)]
    assert plan.slot_mapping == [2 * 16 + 2, *range(7 * 16 + 4, 7 * 16 + 16), *range(48, 52)]
    assert (plan.decode_block_tables, plan.decode_context_lens) == ([[2]], [3])
    assert plan.prefills == [PrefillPlan(1, num_tokens=16, num_computed=4, block_table=[7, 3])]
    assert plan.sample_rows == [16, 0]  # the prefill reaches its last token, then the decode
    assert pickle.loads(pickle.dumps(plan)) == plan  # what the pipe to a worker does


@pytest.mark.parametrize(
    ("module", "a_rows", "a_cols", "b_rows", "b_cols"),
    [
        # column-parallel: A [r, in] whole, B [out, r] split on its output features
        ("q_proj", slice(0, 4), slice(0, 6), slice(3, 6), slice(0, 4)),
        ("up_proj", slice(0, 4), slice(0, 6), slice(3, 6), slice(0, 4)),
        # row-parallel: A split on its input features, B whole
        ("o_proj", slice(0, 4), slice(3, 6), slice(0, 6), slice(0, 4)),
        ("down_proj", slice(0, 4), slice(3, 6), slice(0, 6), slice(0, 4)),
    ],
)
def test_lora_shard_follows_the_base_weights_split(
    module: str, a_rows: slice, a_cols: slice, b_rows: slice, b_cols: slice
) -> None:
    a, b = torch.arange(24.0).view(4, 6), torch.arange(24.0).view(6, 4)  # A [r, in], B [out, r]
    a1, b1 = TPGroup(1, 2).shard_lora(module, a, b)
    assert a1.equal(a[a_rows, a_cols]) and b1.equal(b[b_rows, b_cols])
    assert TPGroup(0, 1).shard_lora(module, a, b) == (a, b)
    assert lora_shard_dim(module) in ((None, 0), (1, None))
