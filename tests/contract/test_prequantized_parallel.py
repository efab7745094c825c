"""Tensor parallelism over a pre-quantised checkpoint (checkpoint_quant.check_prequantized_
parallel): a rank's share of o_proj's and down_proj's input must be whole groups, and GPTQ's
act-order, whose groups spread over the whole input, is refused.

Figures by hand: Qwen2.5-7B's o_proj takes 3584 inputs and down_proj 18944; in groups of 128,
2 and 4 ranks get 1792 / 896 and 9472 / 4736 (whole groups), 8 ranks 448 and 2368 (3.5 and
18.5 groups: refused, as vLLM refuses them)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.contract.checkpoint_quant import (
    check_prequantized_parallel,
    parse_quantization_config,
)
from tests.support.checkpoint_configs import QWEN25_7B_AWQ, QWEN25_7B_CT_INT4, QWEN25_7B_GPTQ

ROW_INPUTS = {
    "model.layers.0.self_attn.o_proj": 3584,
    "model.layers.0.mlp.down_proj": 18944,
}


def quant_of(config: dict[str, Any], **changes: Any) -> Any:
    return parse_quantization_config(config | {
        "quantization_config": config["quantization_config"] | changes
    })  # fmt: skip


@pytest.mark.parametrize(
    ("config", "changes", "tp", "refused"),
    [
        (QWEN25_7B_AWQ, {}, 1, None),
        (QWEN25_7B_AWQ, {}, 2, None),
        (QWEN25_7B_AWQ, {}, 4, None),
        (QWEN25_7B_AWQ, {}, 8, "o_proj has 3584 input features, 448 a rank, not whole groups"),
        (QWEN25_7B_GPTQ, {"desc_act": False}, 4, None),
        (QWEN25_7B_GPTQ, {"desc_act": True}, 2, r"act-order \(desc_act\)"),
        (QWEN25_7B_GPTQ, {"desc_act": True}, 1, None),
        (QWEN25_7B_GPTQ, {"desc_act": False, "group_size": -1}, 8, None),  # one scale a row
        (QWEN25_7B_CT_INT4, {}, 4, None),
        (QWEN25_7B_CT_INT4, {}, 8, "o_proj has 3584 input features, 448 a rank"),
    ],
)
def test_a_ranks_share_of_a_row_parallel_input_is_whole_groups(
    config: dict[str, Any], changes: dict[str, Any], tp: int, refused: str | None
) -> None:
    quant = quant_of(config, **changes)
    if refused is None:
        check_prequantized_parallel(quant, tp, ROW_INPUTS)
        return
    with pytest.raises(ValueError, match=refused) as error:
        check_prequantized_parallel(quant, tp, ROW_INPUTS)
    assert f"--tensor-parallel-size {tp}" in str(error.value)


def test_without_the_shapes_only_the_scheme_is_checked() -> None:
    """The operator checks before it has read the shapes: act-order alone is refused."""
    check_prequantized_parallel(quant_of(QWEN25_7B_AWQ), 8)
    with pytest.raises(ValueError, match="desc_act"):
        check_prequantized_parallel(quant_of(QWEN25_7B_GPTQ, desc_act=True), 2)
