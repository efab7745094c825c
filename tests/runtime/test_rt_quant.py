"""Quantisation: round-trip error bounds, the packed kernels against the dequantised reference
(one matrix and the whole model, int8 through both its kernels), the int8 kernel chosen per
device, embedding rows from the packed layout, and memory against the planner's arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvpilot.contract import memory
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.model_runner import load_model
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.sizing import model_facts
from kvpilot.runtime.evaluate import window_logits
from kvpilot.runtime.layers.quant import (
    DenseWeight,
    Int4Weight,
    Int8DynamicWeight,
    Int8Weight,
    Weight,
    make_weight,
    resolve_int8_kernel,
)
from kvpilot.runtime.models.llama import LlamaModel
from kvpilot.runtime.models.loader import load_model_config
from kvpilot.runtime.models.tokenizer_files import Tokenizer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

CPU_CAPABILITY = torch.backends.cpu.get_cpu_capability()
# The int4 kernel's tile layouts rows are read from; this CPU runs its own and every lower one.
TILED_CAPABILITIES = {"AVX512": ["avx512", "avx2"], "AVX2": ["avx2"]}.get(CPU_CAPABILITY, [])


def random_weight(out_features: int, in_features: int) -> torch.Tensor:
    torch.manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features)
    w[3] *= 50  # one loud output channel must not spoil the others' precision
    return w


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return random_weight(96, 300)  # in_features not a multiple of 16 or 128: padding


def test_int8_error_within_half_a_step_per_channel(weight: torch.Tensor) -> None:
    q = Int8Weight(weight)
    error = (q.dequantize(torch.float32) - weight).abs()  # [out, in]
    step = q.scale.float()[:, None]  # [out, 1]
    assert torch.all(error <= step / 2 + 1e-6 * weight.abs().amax(1, keepdim=True))
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (96, 304)  # padded to 16s


def test_int4_error_within_half_a_step_per_group(weight: torch.Tensor) -> None:
    q = Int4Weight(weight, rows_needed=True)
    assert q.packed.dtype == torch.uint8 and q.packed.numel() == 96 * 384 // 2  # two per byte
    assert q.scales_and_zeros.shape == (3, 96, 2)  # groups of 128 over 300 (padded to 384)
    restored = q.dequantize(torch.float32)
    assert restored.shape == weight.shape
    step = q.scales_and_zeros[:, :, 0].t().float().repeat_interleave(128, dim=1)[:, :300]
    assert torch.all((restored - weight).abs() <= step / 2 + 1e-5)


# (level, out_features, in_features, compute dtype): shapes of tiny-llama's matrices, ragged
# ones (a tile of 64 rows half full, inputs padded to 16 and to 128) and fp32 compute, whose
# activations the kernels take in bf16.
KERNEL_CASES = [
    (level, out_f, in_f, dtype)
    for level in ("int8", "int4")
    for out_f, in_f in [(384, 256), (1376, 256), (256, 688), (96, 300)]
    for dtype in (torch.bfloat16, torch.float32)
]


@pytest.mark.parametrize(("level", "out_features", "in_features", "dtype"), KERNEL_CASES)
def test_kernel_equals_dequantized_reference(
    level: str, out_features: int, in_features: int, dtype: torch.dtype
) -> None:
    """The packed kernel computes x @ W.T of the very matrix `dequantize` returns; only the
    bf16 rounding of activations and outputs separates them."""
    w = make_weight(random_weight(out_features, in_features), level, dtype)
    x = torch.randn(7, in_features, dtype=dtype)
    bias = torch.randn(out_features, dtype=dtype)
    out = w.linear(x, bias)
    assert out.dtype == dtype and out.shape == (7, out_features)
    reference = x.to(torch.bfloat16).float() @ w.dequantize(torch.float32).T + bias.float()
    error = float((out.float() - reference).norm() / reference.norm())
    assert error < 8e-3, error


@pytest.mark.parametrize(
    ("out_features", "in_features", "dtype"),
    [(384, 256, torch.bfloat16), (96, 300, torch.float32), (1376, 256, torch.bfloat16)],
)
def test_int8_dynamic_equals_its_integer_reference(
    out_features: int, in_features: int, dtype: torch.dtype
) -> None:
    """W8A8: each activation row quantised to int8 with scale absmax / 127, int32 products of
    the stored int8 weights; the reference does that arithmetic in float64 (exact), so only
    the output's rounding to `dtype` separates them."""
    int8 = Int8Weight(random_weight(out_features, in_features), dtype)
    dynamic = Int8DynamicWeight(int8)
    x = torch.randn(5, in_features, dtype=dtype)
    x64 = x.double()
    x_scale = x64.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(x.float() / x_scale.float()).double()  # as the kernel rounds, in fp32
    weights = int8.qweight[:, :in_features].double() * int8.scale.double()[:, None]
    reference = (xq @ weights.T) * x_scale
    out = dynamic.linear(x)
    assert out.dtype == dtype
    error = float((out.double() - reference).norm() / reference.norm())
    assert error < (4e-3 if dtype == torch.bfloat16 else 1e-6), error
    # Against the unquantised activations the error is int8's, bounded but not tiny.
    exact = x64 @ weights.T
    assert 1e-4 < float((out.double() - exact).norm() / exact.norm()) < 0.02
    assert dynamic.num_bytes() == int8.num_bytes()  # the same stored weights, no copy


@pytest.mark.parametrize(
    ("quantization", "out_features"),
    [(q, n) for q in ("none", "bf16", "int8", "int4") for n in (96, 128)],
)
def test_rows_equal_dequantized_rows(quantization: str, out_features: int) -> None:
    """A tied embedding looks rows up in the same quantised matrix the lm_head multiplies by."""
    stored = make_weight(random_weight(out_features, 300), quantization, torch.float32, True)
    ids = torch.tensor([0, 3, 95, 3, 64, 63, 32])
    torch.testing.assert_close(
        stored.rows(ids, torch.float32), stored.dequantize(torch.float32)[ids]
    )


@pytest.mark.skipif(
    not TILED_CAPABILITIES, reason="the CPU int4 tile layouts read in place are AVX512's and AVX2's"
)
@pytest.mark.parametrize(
    ("out_features", "rows_needed", "tiles_readable", "has_copy"),
    [
        (128, True, True, False),  # whole tiles: rows read from the packed kernel layout
        (80, True, False, True),  # part of a tile: the embedding keeps its own copy
        (80, False, False, False),  # a projection never looked up keeps none
    ],
)
def test_int4_rows_from_packed_tiles(
    out_features: int, rows_needed: bool, tiles_readable: bool, has_copy: bool
) -> None:
    w = Int4Weight(random_weight(out_features, 256), rows_needed=rows_needed)
    assert w.tiles_readable is tiles_readable and (w.row_copy is not None) is has_copy
    packed_only = w.packed.numel() + w.scales_and_zeros.numel() * 2
    copy = 0 if w.row_copy is None else w.row_copy.numel()
    assert w.num_bytes() == packed_only + copy


ROWS_THROUGH_THE_KERNEL = """
import json, torch
from kvpilot.runtime.layers.quant import Int4Weight, _pack_for_cpu
torch.manual_seed(0)
w = Int4Weight(torch.randn(128, 256), rows_needed=True)
kernel = w.linear(torch.eye(256, dtype=torch.bfloat16)).t().float()  # I @ W.T, the kernel's view
rows = w.rows(torch.arange(128), torch.float32)
same_packing = []  # the tiles written directly against the kernel's own packing op
for shape in [(64, 96), (128, 256), (192, 1024), (128, 2816), (96, 64), (80, 256)]:
    q = torch.randint(0, 16, shape, dtype=torch.int32)
    op = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    same_packing.append(torch.equal(_pack_for_cpu(q.to(torch.uint8)), op))
    by_input = q.to(torch.uint8).t().contiguous().t()  # [out, in], input-major bytes
    same_packing.append(torch.equal(_pack_for_cpu(by_input), op))
print(json.dumps({
    "capability": torch.backends.cpu.get_cpu_capability(), "tile_rows": w.tile_rows,
    "copy": w.row_copy is not None, "error": float((rows - kernel).norm() / kernel.norm()),
    "same_packing": same_packing,
}))
"""


@pytest.mark.parametrize("capability", TILED_CAPABILITIES)
def test_int4_rows_read_from_each_cpu_kernels_tiles(capability: str) -> None:
    """AVX512 packs 64 rows per tile, AVX2 32 (a CPU without AVX512 used to keep a copy of the
    embedding, 22% over the planner's int4 bytes on tiny-llama): ATEN_CPU_CAPABILITY picks the
    kernel, and the rows read from its tiles must be the rows it multiplies by; the tiles the
    engine writes itself (no int32 copy) must be the bytes the kernel's own packing writes."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    command = [sys.executable, "-c", ROWS_THROUGH_THE_KERNEL]
    run = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    assert seen["capability"] == capability.upper()
    assert seen["tile_rows"] == {"avx512": 64, "avx2": 32}[capability] and not seen["copy"]
    assert seen["error"] < 0.005  # the kernel's bf16 output against exact rows
    assert all(seen["same_packing"]), seen["same_packing"]


def test_int4_rows_refused_without_rows_needed() -> None:
    w = Int4Weight(random_weight(80, 256))  # not whole tiles on any CPU: no rows without a copy
    with pytest.raises(RuntimeError, match="rows_needed"):
        w.rows(torch.tensor([0]), torch.float32)
    # Its reference still comes out, through the kernel: equal to a lookup copy's rows.
    looked_up = Int4Weight(random_weight(80, 256), rows_needed=True)
    torch.testing.assert_close(
        w.dequantize(torch.float32), looked_up.dequantize(torch.float32), rtol=8e-3, atol=1e-2
    )


def test_relative_matmul_error_by_level(weight: torch.Tensor) -> None:
    x = torch.randn(512, 300)
    exact = x @ weight.T
    errors = {}
    for level in ("bf16", "int8", "int4"):
        approx = make_weight(weight, level, torch.float32).linear(x)
        errors[level] = float((approx - exact).norm() / exact.norm())
    assert errors["bf16"] < 0.005 and errors["int8"] < 0.02 and errors["int4"] < 0.2
    assert errors["bf16"] < errors["int8"] < errors["int4"]


def dequantized_copy(model: LlamaModel) -> LlamaModel:
    """The same model with every quantised matrix replaced by its dequantised fp32 values."""

    def dense(w: Weight) -> DenseWeight:
        return DenseWeight(w.dequantize(torch.float32), torch.float32)

    for layer in model.layers:
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            linear.weight = dense(linear.weight)
    tied = model.lm_head is model.embed
    model.embed = dense(model.embed)
    model.lm_head = model.embed if tied else dense(model.lm_head)
    return model


@pytest.mark.parametrize(
    ("level", "int8_kernel"), [("int8", "w8a16"), ("int8", "w8a8"), ("int4", "w8a16")]
)
def test_model_logits_equal_dequantized_model(
    tiny_llama_dir: Path, level: str, int8_kernel: str
) -> None:
    """Every layer through the packed kernels vs the dequantised weights through F.linear,
    fp32 compute: the kernels' bf16 (w8a8: int8, per row) activations are the only difference
    (a misread layout or scale moves the logits by their own size)."""
    cfg, cpu = load_model_config(tiny_llama_dir), torch.device("cpu")
    ids = Tokenizer(tiny_llama_dir).encode((tiny_llama_dir / "eval.txt").read_text()[:2000])[:200]
    model = load_model(tiny_llama_dir, cfg, level, torch.float32, cpu, int8_kernel=int8_kernel)
    if level == "int8":  # the kernel asked for is the one that runs, the lm_head's included
        kernel_type = Int8DynamicWeight if int8_kernel == "w8a8" else Int8Weight
        assert isinstance(model.layers[0].down.weight, kernel_type)
        assert isinstance(model.lm_head, kernel_type)
    quantized = window_logits(model, ids, cpu)
    dequantized = dequantized_copy(load_model(tiny_llama_dir, cfg, level, torch.float32, cpu))
    reference = window_logits(dequantized, ids, cpu)
    assert float((quantized - reference).norm() / reference.norm()) < 0.01
    agree = (quantized.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agree > 0.95


def embedding_row_copy_bytes(engine: Engine) -> int:
    """The copy of its rows an int4 embedding keeps where the kernel's tiles cannot be read
    (CUDA, a CPU with neither AVX512 nor AVX2): 0 on the CPUs CI runs on."""
    embed = engine.runner.model.embed
    copy = getattr(embed, "row_copy", None)
    return 0 if copy is None else int(copy.numel())


def test_weight_memory_ratios_and_arithmetic(make_engine: Callable[..., Engine]) -> None:
    engines = {q: make_engine(quantization=q) for q in ("bf16", "int8", "int4")}
    sizes = {q: engine.weight_bytes for q, engine in engines.items()}
    sizes["int4"] -= embedding_row_copy_bytes(engines["int4"])  # what the planner leaves out
    assert sizes["int8"] <= 0.52 * sizes["bf16"]
    assert sizes["int4"] <= 0.30 * sizes["bf16"]
    facts = model_facts(make_engine().model_config)
    for level, measured in sizes.items():  # the planner's arithmetic predicts the real bytes
        predicted = memory.weight_bytes(facts.parameters, level)
        assert abs(measured - predicted) / predicted < 0.03, level


@pytest.mark.parametrize(
    ("device", "choice", "cpu_has_int8_dot", "expected"),
    [
        ("cpu", "auto", True, "w8a8"),  # VNNI / AMX: int8 x int8 beats the weight-only kernel
        ("cpu", "auto", False, "w8a16"),
        ("cuda", "auto", True, "w8a16"),  # CUDA's _int_mm needs > 16 rows; a decode has 1
        ("cpu", "w8a16", True, "w8a16"),
        ("cpu", "w8a8", False, "w8a8"),  # asked for: runs, without the dot-product speed
        ("cuda", "w8a16", False, "w8a16"),
    ],
)
def test_resolve_int8_kernel(
    device: str, choice: str, cpu_has_int8_dot: bool, expected: str
) -> None:
    assert resolve_int8_kernel(choice, torch.device(device), cpu_has_int8_dot) == expected


def test_w8a8_on_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="w8a8 runs on CPU only, not cuda; use w8a16 or auto"):
        resolve_int8_kernel("w8a8", torch.device("cuda"), True)


@pytest.mark.parametrize(
    ("quantization", "int8_kernel"), [("int8", "w8a16"), ("int8", "w8a8"), ("int4", "auto")]
)
def test_quantized_engine_generates(
    make_engine: Callable[..., Engine], quantization: str, int8_kernel: str
) -> None:
    engine = make_engine(quantization=quantization, int8_kernel=int8_kernel)
    engine.add_request("The for statement", SamplingParams(max_tokens=8, temperature=0), "q")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) >= 1
