"""A checkpoint that quantises its lm_head (GPTQ/AWQ `lm_head: true`, compressed-tensors with
lm_head among its targets): parsed, planned with the lm_head's packed bytes, refused where the
model ties it to the embedding.

Figures by hand: Qwen2.5-7B's lm_head is 3584 x 152064; at int4 group 128 it costs
0.5 + 4/128 bytes a parameter as every packed decoder projection does, else 2 (bf16).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.contract.checkpoint_quant import checkpoint_kind, parse_quantization_config
from kvpilot.contract.checkpoint_weights import read_checkpoint_weights
from tests.support.checkpoint_configs import (
    QWEN25_7B,
    QWEN25_7B_AWQ,
    QWEN25_7B_CT_INT4,
    QWEN25_7B_GPTQ,
    QWEN25_7B_LAYER,
)

LM_HEAD = 3584 * 152064
DECODER = 28 * QWEN25_7B_LAYER
INT4_G128 = 0.5 + 4 / 128


def with_qc(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return base | {"quantization_config": base["quantization_config"] | changes}


TIED = {"tie_word_embeddings": True}
GPTQ_HEAD = with_qc(QWEN25_7B_GPTQ, lm_head=True)
# GPTQModel quantises the lm_head as a `dynamic` entry for it says (its default: 8 bits, group 32)
GPTQMODEL_DEFAULT_HEAD = {"bits": 8, "group_size": 32, "sym": True, "desc_act": False, "mse": 2.4}
GPTQ_HEAD_G32 = with_qc(
    GPTQ_HEAD, dynamic={"lm_head": GPTQMODEL_DEFAULT_HEAD | {"bits": 4}, "-:.*mlp.*": {}}
)
AWQ_HEAD = with_qc(QWEN25_7B_AWQ, lm_head=True)
CT_HEAD = with_qc(QWEN25_7B_CT_INT4, ignore=[])
# compressed-tensors' targets may name modules: one group for the decoder, one for the lm_head
CT_HEAD_BY_NAME = with_qc(
    QWEN25_7B_CT_INT4,
    ignore=[],
    config_groups={
        "group_0": QWEN25_7B_CT_INT4["quantization_config"]["config_groups"]["group_0"]
        | {"targets": ["re:.*self_attn.*", "re:.*mlp.*", "lm_head"]}
    },
)


@pytest.mark.parametrize(
    ("config", "lm_head_quantised", "kind"),
    [
        (QWEN25_7B_GPTQ, False, "gptq-int4"),  # no `lm_head` field: false, as GPTQ defaults it
        (with_qc(QWEN25_7B_GPTQ, lm_head=False), False, "gptq-int4"),
        (GPTQ_HEAD, True, "gptq-int4"),
        (QWEN25_7B_AWQ, False, "awq-int4"),
        (AWQ_HEAD, True, "awq-int4"),
        (QWEN25_7B_CT_INT4, False, "compressed-tensors-int4"),  # ignore: [lm_head]
        (CT_HEAD, True, "compressed-tensors-int4"),  # targets Linear, nothing ignored
        (CT_HEAD_BY_NAME, True, "compressed-tensors-int4"),
        # a tied model whose lm_head is not quantised is served as before
        (QWEN25_7B_CT_INT4 | TIED, False, "compressed-tensors-int4"),
        (QWEN25_7B_GPTQ | TIED, False, "gptq-int4"),
    ],
)
def test_the_config_says_whether_the_lm_head_is_quantised(
    config: dict[str, Any], lm_head_quantised: bool, kind: str
) -> None:
    quant = parse_quantization_config(config)
    assert quant is not None
    assert (quant.scheme_for("lm_head") is not None) == lm_head_quantised
    assert quant.scheme_for("model.layers.3.mlp.down_proj") is not None
    assert checkpoint_kind(quant) == kind  # --expect-checkpoint's kind: the lm_head adds none


@pytest.mark.parametrize(
    ("config", "quantized_parameters"),
    [
        (QWEN25_7B_GPTQ, DECODER),
        (GPTQ_HEAD, DECODER + LM_HEAD),
        (QWEN25_7B_AWQ, DECODER),
        (AWQ_HEAD, DECODER + LM_HEAD),
        (QWEN25_7B_CT_INT4, DECODER),
        (CT_HEAD, DECODER + LM_HEAD),
        (CT_HEAD_BY_NAME, DECODER + LM_HEAD),
        # its own group size (dynamic.lm_head), beside the `-:` skip of the MLP
        (GPTQ_HEAD_G32, 28 * 3584 * (4608 + 3584) + LM_HEAD),
        # GPTQModel's `-:` skips and AWQ's modules_to_not_convert still leave their modules out
        (with_qc(GPTQ_HEAD, dynamic={"-:.*mlp.*": {}}), 28 * 3584 * (4608 + 3584) + LM_HEAD),
        (with_qc(AWQ_HEAD, modules_to_not_convert=["mlp"]), 28 * 3584 * (4608 + 3584) + LM_HEAD),
    ],
)
def test_a_quantised_lm_head_is_planned_at_its_packed_bytes(
    config: dict[str, Any], quantized_parameters: int
) -> None:
    weights = read_checkpoint_weights(config)
    assert weights is not None
    assert weights.quantized_parameters == quantized_parameters
    head_bytes = LM_HEAD * ((0.5 + 4 / 32) - INT4_G128) if config is GPTQ_HEAD_G32 else 0
    assert weights.quantized_bytes == pytest.approx(quantized_parameters * INT4_G128 + head_bytes)


def test_gptqmodels_lm_head_entry_gives_the_lm_head_its_own_scheme() -> None:
    quant = parse_quantization_config(GPTQ_HEAD_G32)
    assert quant is not None
    head, rest = quant.scheme_for("lm_head"), quant.scheme_for("model.layers.0.mlp.up_proj")
    assert head is not None and rest is not None
    assert (head.group_size, head.desc_act, head.num_bits) == (32, False, 4)
    assert (rest.group_size, rest.desc_act) == (128, False)
    assert quant.level == "int4" and checkpoint_kind(quant) == "gptq-int4"


def test_the_lm_head_saves_three_quarters_of_its_bf16_bytes() -> None:
    """What the planner sees: the same checkpoint with the lm_head packed holds its bf16 bytes
    (2 a parameter) less its packed ones, 6.5 in 8 of 1.02 GiB, fewer."""
    without, with_head = read_checkpoint_weights(QWEN25_7B_GPTQ), read_checkpoint_weights(GPTQ_HEAD)
    assert without is not None and with_head is not None
    saved = (with_head.quantized_parameters - without.quantized_parameters) * 2 - (
        with_head.quantized_bytes - without.quantized_bytes
    )
    assert saved == pytest.approx(LM_HEAD * (2 - INT4_G128))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # tied: the lm_head is the embedding; a quantised copy of it is refused, naming the field
        (GPTQ_HEAD | TIED, "quantization_config.lm_head: true with tie_word_embeddings: true is "
         "not supported"),
        (AWQ_HEAD | TIED, "quantization_config.lm_head: true with tie_word_embeddings: true"),
        (CT_HEAD | TIED, 'quantization_config.ignore: [] quantises lm_head with '
         "tie_word_embeddings: true is not supported"),
        (with_qc(CT_HEAD, ignore=["re:.*down_proj"]) | TIED,
         'quantization_config.ignore: ["re:.*down_proj"] quantises lm_head'),
        (CT_HEAD_BY_NAME | TIED, "untie the model before quantising"),
        # GPTQModel's default lm_head entry: 8 bits in groups of 32, no packed kernel here
        (with_qc(GPTQ_HEAD, dynamic={"lm_head": GPTQMODEL_DEFAULT_HEAD}),
         "quantization_config.dynamic.lm_head.bits: 8 is not supported; supported: 4"),
        (with_qc(GPTQ_HEAD, dynamic={"lm_head": {"bits": 4, "group_size": 256}}),
         "quantization_config.dynamic.lm_head.group_size: 256 is not supported"),
        (with_qc(GPTQ_HEAD, dynamic={"lm_head": {"bits": 4, "v2": True}}),
         "quantization_config.dynamic.lm_head.v2: True is not supported"),
        # another module's override is still refused
        (with_qc(GPTQ_HEAD, dynamic={"model.layers.0.mlp.up_proj": {"bits": 8}}),
         "quantization_config.dynamic.model.layers.0.mlp.up_proj: "),
        # `lm_head` must be a boolean
        (with_qc(QWEN25_7B_GPTQ, lm_head="true"),
         'quantization_config.lm_head: "true" is not supported; supported: True, False'),
        (with_qc(QWEN25_7B_AWQ, lm_head=1), "quantization_config.lm_head: 1 is not supported"),
    ],
)  # fmt: skip
def test_refused_lm_head_configs_name_the_field(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_quantization_config(config)
    assert message in str(error.value)
    with pytest.raises(ValueError):  # the operator plans with the same parser: same refusal
        read_checkpoint_weights(config)


def test_an_untied_16_bit_checkpoint_is_unaffected() -> None:
    assert parse_quantization_config(QWEN25_7B) is None
    assert parse_quantization_config(QWEN25_7B | TIED) is None
