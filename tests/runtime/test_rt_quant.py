"""Weight-only quantisation: round-trip error bounds, packing, and memory against the arithmetic."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvpilot.runtime import memory
from kvpilot.runtime.engine import Engine, model_facts
from kvpilot.runtime.layers.quant import Int4Weight, Int8Weight, make_weight
from kvpilot.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(96, 300)  # in_features not a multiple of 128: exercises group padding
    w[3] *= 50  # one loud output channel must not spoil the others' precision
    return w


def test_int8_error_within_half_a_step_per_channel(weight: torch.Tensor) -> None:
    q = Int8Weight(weight)
    error = (q.dequantize(torch.float32) - weight).abs()  # [out, in]
    step = q.scale.float()  # [out, 1]
    assert torch.all(error <= step / 2 + 1e-6 * weight.abs().amax(1, keepdim=True))
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == weight.shape


def test_int4_error_within_half_a_step_per_group(weight: torch.Tensor) -> None:
    q = Int4Weight(weight)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (96, 384 // 2)  # two per byte
    assert q.scale.shape == (96, 3)  # groups of 128 over 300 (padded to 384) inputs
    restored = q.dequantize(torch.float32)
    assert restored.shape == weight.shape
    step = q.scale.float().repeat_interleave(128, dim=1)[:, :300]
    assert torch.all((restored - weight).abs() <= step / 2 + 1e-5)


@pytest.mark.parametrize("quantization", ["none", "bf16", "int8", "int4"])
def test_rows_equal_dequantized_rows(weight: torch.Tensor, quantization: str) -> None:
    """A tied embedding looks rows up in the same quantised matrix the lm_head multiplies by."""
    stored = make_weight(weight, quantization, torch.float32)
    ids = torch.tensor([0, 3, 95, 3])
    torch.testing.assert_close(
        stored.rows(ids, torch.float32), stored.dequantize(torch.float32)[ids]
    )


def test_relative_matmul_error_by_level(weight: torch.Tensor) -> None:
    x = torch.randn(512, 300)
    exact = x @ weight.T
    errors = {}
    for level in ("bf16", "int8", "int4"):
        approx = x @ make_weight(weight, level, torch.float32).dequantize(torch.float32).T
        errors[level] = float((approx - exact).norm() / exact.norm())
    assert errors["bf16"] < 0.005 and errors["int8"] < 0.02 and errors["int4"] < 0.2
    assert errors["bf16"] < errors["int8"] < errors["int4"]


def test_weight_memory_ratios_and_arithmetic(make_engine: Callable[..., Engine]) -> None:
    sizes = {q: make_engine(quantization=q).weight_bytes for q in ("bf16", "int8", "int4")}
    assert sizes["int8"] <= 0.52 * sizes["bf16"]
    assert sizes["int4"] <= 0.30 * sizes["bf16"]
    facts = model_facts(make_engine().model_config)
    for level, measured in sizes.items():  # the planner's arithmetic predicts the real bytes
        predicted = memory.weight_bytes(facts.parameters, level)
        assert abs(measured - predicted) / predicted < 0.03, level


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_engine_generates(make_engine: Callable[..., Engine], quantization: str) -> None:
    engine = make_engine(quantization=quantization)
    engine.add_request("The for statement", SamplingParams(max_tokens=8, temperature=0), "q")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) >= 1
