"""GPTQ and AWQ checkpoints: the config checked and refused field by field, act-order's groups
made consecutive, and tiny-llama quantised by GPTQModel itself run against transformers on the
same checkpoint dequantised by GPTQModel's own code (matrices, logits, greedy tokens,
perplexity)."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.reference.gptq_awq import (
    VARIANTS,
    WRITER,
    dequantized_model,
    dequantized_state_dict,
    reference_key,
    writer_files,
)
from bench.reference.models import hf_greedy, hf_logits, our_logits, run_all
from kvpilot.contract.checkpoint_quant import (
    check_prequantized_parallel,
    parse_quantization_config,
)
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.model_runner import load_model
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.evaluate import samples_for, score
from kvpilot.runtime.layers import packed_int4, paged_kernel
from kvpilot.runtime.layers.packed_int4 import (
    AWQ_ORDER,
    Int4Words,
    PermutedWeight,
    act_order_permutation,
    unpack_awq,
    unpack_input_major,
    unpack_int32,
    unpack_words,
    words_cpu_tiles,
)
from kvpilot.runtime.layers.prequant import (
    Int8Parts,
    Matrix,
    Read,
    concat,
    dequantize,
    permute_rows,
    read_matrix,
    split_input_order,
    store,
)
from kvpilot.runtime.layers.quant import (
    CPU_INT4_TILE_ROWS,
    DenseWeight,
    Int4Parts,
    Int4Weight,
    _pack_cpu_tiles,
)
from kvpilot.runtime.models.loader import load_model_config, open_weights
from kvpilot.runtime.models.tokenizer_files import Tokenizer
from tests.support.prequant_reference import (
    LOGIT_TOLERANCE,
    PROMPTS,
    assert_greedy_matches,
    assert_shards_read_as_slices,
    gptqmodel_checkpoint,
    hf_perplexity,
)

CPU = torch.device("cpu")
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq", "lm_head": False, "pack_dtype": "int32"}  # fmt: skip
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
       "version": "gemm", "modules_to_not_convert": None}  # fmt: skip


@pytest.mark.parametrize(
    ("base", "changes", "described"),
    [
        (GPTQ, {}, "gptq int4 (gptq, group 128)"),
        (GPTQ, {"group_size": 32, "desc_act": True, "sym": False},
         "gptq int4 (gptq, group 32, asymmetric, desc_act)"),
        (GPTQ, {"group_size": -1, "checkpoint_format": "gptq_v2"}, "int4 (gptq_v2, channel)"),
        (GPTQ, {"checkpoint_format": None, "format": "gptq_v2"}, "int4 (gptq_v2, group 128)"),
        (GPTQ, {"dynamic": {r"-:.*down_proj": {}}}, "gptq int4 (gptq, group 128)"),
        (AWQ, {"group_size": 64}, "awq int4 (awq-gemm, group 64, asymmetric)"),
        (AWQ, {"version": "GEMM", "bits": None, "w_bit": 4}, "awq int4 (awq-gemm, group 128"),
        (AWQ, {"zero_point": False}, "awq int4 (awq-gemm, group 128)"),
    ],
)  # fmt: skip
def test_supported_configs(base: dict[str, Any], changes: dict[str, Any], described: str) -> None:
    quant = parse_quantization_config({"quantization_config": {**base, **changes}})
    assert quant is not None and described in quant.describe() and quant.level == "int4"


@pytest.mark.parametrize(
    ("base", "changes", "message"),
    [
        (GPTQ, {"bits": 3}, "quantization_config.bits: 3 is not supported; supported: 4"),
        (GPTQ, {"bits": 8}, "quantization_config.bits: 8 is not supported"),
        (GPTQ, {"group_size": 256},
         "group_size: 256 is not supported; supported: 32, 64, 128, -1"),
        (GPTQ, {"group_size": 16}, "group_size: 16 is not supported"),
        (GPTQ, {"checkpoint_format": "marlin"},
         'checkpoint_format: "marlin" is not supported; supported: gptq, gptq_v2'),
        (GPTQ, {"lm_head": "yes"},
         'quantization_config.lm_head: "yes" is not supported; supported: True, False'),
        (GPTQ, {"pack_dtype": "int16"}, 'pack_dtype: "int16" is not supported'),
        (GPTQ, {"dynamic": {r"+:.*down_proj": {"bits": 8}}},
         r'dynamic.+:.*down_proj: {'),
        (AWQ, {"bits": 3}, "quantization_config.bits: 3 is not supported"),
        (AWQ, {"group_size": -1}, "group_size: -1 is not supported; supported: 32, 64, 128"),
        (AWQ, {"version": "gemv"}, 'version: "gemv" is not supported; supported: gemm'),
        (AWQ, {"version": "marlin"}, 'version: "marlin" is not supported'),
        (AWQ, {"quant_method": "bitsandbytes"},
         'quant_method: "bitsandbytes" is not supported; supported: compressed-tensors, gptq, '
         "awq"),
    ],
)  # fmt: skip
def test_refused_configs_name_the_field(
    base: dict[str, Any], changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as error:
        parse_quantization_config({"quantization_config": {**base, **changes}})
    assert message in str(error.value)


def test_awq_nibble_order_is_undone() -> None:
    """AWQ's packer puts output 8b + AWQ_ORDER[k] into nibble k of a word."""
    values = torch.randint(0, 16, (3, 24), dtype=torch.int32)
    words = torch.zeros(3, 3, dtype=torch.int32)
    for k, column in enumerate(AWQ_ORDER):
        words |= values[:, column::8] << (4 * k)
    assert torch.equal(unpack_awq(words), values)
    assert torch.equal(unpack_int32(words, 4, 24)[:, :8], values[:, list(AWQ_ORDER)])


def test_gptq_words_unpack_input_major_as_they_do_output_major() -> None:
    """Act-order reads qweight [in / 8, out] with the input features as rows (their gather into
    group order is then a gather of rows); the values are the ones unpacked output-major."""
    qweight = torch.randint(-(2**31), 2**31 - 1, (5, 12), dtype=torch.int32)
    by_output = unpack_int32(qweight.t().contiguous(), 4, 38)  # [out, in], the row cut short
    assert torch.equal(unpack_input_major(qweight, 38), by_output.t())


@pytest.mark.parametrize(
    ("g_idx", "group_size", "expected"),
    [
        ([0, 0, 1, 1, 2], 2, None),  # consecutive: no permutation
        ([1, 0, 2, 0, 1], 2, [1, 3, 0, 4, 2]),  # act-order: sorted by group, stably
        ([2, 1, 0, 0, 1, 0], 2, "puts a number of input features other than group_size"),
    ],
)
def test_act_order_makes_groups_consecutive(
    g_idx: list[int], group_size: int, expected: list[int] | str | None
) -> None:
    args = ("m", torch.tensor(g_idx), group_size, len(g_idx), True)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            act_order_permutation(*args)
        return
    perm = act_order_permutation(*args)
    assert (None if perm is None else perm.tolist()) == expected


@pytest.mark.parametrize(
    ("change", "same_key"),
    [
        (lambda model: None, True),  # a copy elsewhere: the directory's path is not in the key
        (lambda model: (model / "eval.txt").write_text("other calibration text"), False),
        (lambda model: (model / "config.json").write_bytes(b"{}"), False),
        (lambda model: (model / "extra.json").write_text("{}"), False),
    ],
)
def test_reference_cache_key_follows_the_models_files(
    tmp_path: Path, tiny_llama_dir: Path, change: Callable[[Path], object], same_key: bool
) -> None:
    """A variant is written again when what GPTQModel reads changes, and only then."""
    model = shutil.copytree(tiny_llama_dir, tmp_path / "tiny-llama")
    change(model)
    assert (reference_key(model) == reference_key(tiny_llama_dir)) == same_key


def test_the_lm_head_variants_have_a_key_of_their_own(tiny_llama_dir: Path) -> None:
    """The `-head` variants' writer is hashed into their key alone: adding it left the key of
    the others (what a warm cache holds) as it was."""
    assert writer_files("gptq-g128") == [WRITER]
    assert reference_key(tiny_llama_dir) == reference_key(tiny_llama_dir, [WRITER])
    head_key = reference_key(tiny_llama_dir, writer_files("gptq-g128-desc-head"))
    assert head_key != reference_key(tiny_llama_dir)


@pytest.mark.parametrize(
    ("lm_head", "tensors", "message"),
    [
        (True, {"lm_head.weight": torch.zeros(8, 8)},
         "missing tensor 'lm_head.qweight' (its quantization_config.lm_head is true)"),
        (False, {"lm_head.qweight": torch.zeros(1, 8, dtype=torch.int32)},
         "missing tensor 'lm_head.weight'"),
    ],
)  # fmt: skip
def test_the_lm_head_is_read_as_the_config_says(
    lm_head: bool, tensors: dict[str, torch.Tensor], message: str
) -> None:
    """`lm_head` decides, not the tensors (as for the decoder's modules a quantiser skipped):
    the planner counted the lm_head's bytes by it."""
    quant = parse_quantization_config({"quantization_config": GPTQ | {"lm_head": lm_head}})
    with pytest.raises(ValueError, match=re.escape(message)):
        read_matrix(tensors.get, "lm_head", quant)


@pytest.mark.slow
def test_references_offline_on_a_cold_cache_say_why_and_write_nothing(tmp_path: Path) -> None:
    """`make gptq-refs` without PyPI and an empty cache: the set-up goes on (the tests skip with
    the same reason) and no half-written variant is left behind."""
    env = {**os.environ, "KVPILOT_CACHE_DIR": str(tmp_path), "UV_OFFLINE": "1", "PIP_NO_INDEX": "1"}
    command = [sys.executable, "-m", "bench.reference.gptq_awq", "gptq-g128"]
    root = Path(__file__).resolve().parents[2]
    ran = subprocess.run(
        command, check=False, cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stderr
    assert "GPTQ/AWQ references not built, their tests skip" in ran.stderr
    assert "it needs PyPI the first time" in ran.stderr
    written = [p.name for p in (tmp_path / "gptq-refs").glob("*/*") if p.is_dir()]
    assert written == []


def _int4_parts(out_features: int, in_features: int) -> Int4Parts:
    groups = in_features // 8
    return Int4Parts(
        torch.randint(0, 16, (out_features, in_features), dtype=torch.int32),
        torch.rand(out_features, groups).bfloat16(),
        torch.randn(out_features, groups).bfloat16(),
        8,
        in_features,
    )


def _gptq_parts(
    out_features: int,
    in_features: int,
    act_order: bool,
    group_size: int = 8,
    layout: str = "gptq",
) -> Int4Words:
    """Random words as GPTQ stores them, as compressed-tensors does (GPTQ's transposed: a
    view) or as AWQ does ([in, out / 8], packed along the output)."""
    groups = -(-in_features // group_size)
    shape = (
        (in_features, out_features // 8)
        if layout == "awq"
        else (-(-in_features // 8), out_features)
    )
    words = torch.randint(-(2**31), 2**31 - 1, shape)
    words = words.t().contiguous().t() if layout == "ct" else words
    return Int4Words(
        (words.to(torch.int32),),
        torch.rand(out_features, groups).bfloat16(),
        torch.randn(out_features, groups).bfloat16(),
        group_size,
        in_features,
        torch.randperm(in_features) if act_order else None,
        awq=layout == "awq",
    )


def _matrix(kind: str, out_features: int, in_features: int) -> Matrix:
    if kind == "dense":
        return torch.randn(out_features, in_features)
    if kind == "int8":
        values = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
        return Int8Parts(values, torch.rand(out_features) / 127)
    if kind == "int4":
        return _int4_parts(out_features, in_features)
    layout = "awq" if kind == "awq" else "gptq"
    return _gptq_parts(out_features, in_features, kind == "gptq act-order", layout=layout)


@pytest.mark.parametrize("kind", ["dense", "int8", "int4", "gptq", "gptq act-order", "awq"])
def test_output_rows_move_in_every_format(kind: str) -> None:
    """Output feature i taken from row rows[i], the matrix kept in its format (and an act-order
    matrix's input order kept)."""
    torch.manual_seed(0)
    matrix, rows = _matrix(kind, 24, 16), torch.randperm(24)
    moved = permute_rows(matrix, rows)
    assert type(moved) is (Int4Parts if kind == "awq" else type(matrix))  # AWQ: unpacked
    torch.testing.assert_close(dequantize(moved), dequantize(matrix)[rows])


@pytest.fixture(params=["compiled", "tensor ops"])
def compiled(request: pytest.FixtureRequest) -> bool:
    """Which tile writer words_cpu_tiles runs: torch.ops.kvpilot.int4_tiles or tensor ops."""
    if request.param == "compiled":
        paged_kernel.load()
    return bool(request.param == "compiled")


@pytest.mark.parametrize("layout", ["gptq", "ct", "awq"])
@pytest.mark.parametrize("tile_rows", CPU_INT4_TILE_ROWS)
@pytest.mark.parametrize(
    ("in_features", "group_size", "act_order"),
    [(256, 128, False), (256, 32, True), (688, 128, False), (688, 128, True), (40, 32, True)],
)  # 688: tiny-llama's MLP, padded to 768 (six groups of 128)
def test_words_are_written_into_the_cpu_tiles_as_packing_unpacked_values_would(
    tile_rows: int, in_features: int, group_size: int, act_order: bool, layout: str, compiled: bool
) -> None:
    """Every byte equal to the tiles the engine writes from unpacked values, for both tile
    heights (AVX512's 64 rows and AVX2's 32), GPTQ's, compressed-tensors' and AWQ's words,
    act-order's input order (GPTQ's) and the padding included, by either writer."""
    torch.manual_seed(0)
    act_order = act_order and layout != "awq"
    parts = _gptq_parts(2 * tile_rows, in_features, act_order, group_size, layout)
    unpacked = unpack_words(parts).values
    tiles = words_cpu_tiles(parts, tile_rows, compiled)
    assert torch.equal(tiles, _pack_cpu_tiles(unpacked, tile_rows))


@pytest.mark.parametrize("layout", ["gptq", "ct", "awq"])
@pytest.mark.parametrize("tile_rows", CPU_INT4_TILE_ROWS)
def test_a_ranks_share_of_the_words_is_written_as_a_copy_of_it_would_be(
    layout: str, tile_rows: int, compiled: bool
) -> None:
    """A tensor-parallel rank's outputs are a slice of the checkpoint's words (a view with the
    whole matrix's strides): written as the same words copied out."""
    torch.manual_seed(0)
    whole = _gptq_parts(4 * tile_rows, 256, False, 32, layout)
    cut = slice(tile_rows // 8, 3 * tile_rows // 8) if layout == "awq" else slice(64, 128)
    words = whole.words[0].t()[cut].t() if layout == "ct" else whole.words[0][:, cut]
    share = replace(whole, words=(words,))
    expected = words_cpu_tiles(replace(share, words=(words.contiguous(),)), tile_rows, False)
    assert not words.is_contiguous()
    assert torch.equal(words_cpu_tiles(share, tile_rows, compiled), expected)


@pytest.mark.parametrize("layout", ["gptq", "ct", "awq"])
@pytest.mark.parametrize("tile_rows", CPU_INT4_TILE_ROWS)
def test_fused_modules_are_written_each_into_its_own_tiles(
    layout: str, tile_rows: int, compiled: bool
) -> None:
    """q/k/v (or gate/up) fused keep each module's words; the tiles are those of the words
    side by side."""
    torch.manual_seed(0)
    first, second = (_gptq_parts(n * tile_rows, 256, False, 32, layout) for n in (2, 1))
    fused = concat([first, second])
    assert isinstance(fused, Int4Words) and len(fused.words) == 2
    side_by_side = replace(fused, words=(fused.all_words(),))
    expected = words_cpu_tiles(side_by_side, tile_rows, compiled=False)
    assert torch.equal(words_cpu_tiles(fused, tile_rows, compiled), expected)
    torch.testing.assert_close(
        dequantize(fused), torch.cat([dequantize(first), dequantize(second)])
    )


@pytest.mark.parametrize(("layout", "act_order"), [("gptq", False), ("gptq", True), ("ct", False)])
@pytest.mark.parametrize("tile_rows", CPU_INT4_TILE_ROWS)
def test_reordered_outputs_are_written_as_their_words_gathered(
    layout: str, act_order: bool, tile_rows: int, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Act-order's fold reorders gate/up's outputs as their words are written into tiles, a
    block of tiles at a time (one tile a block here): every byte as the words gathered first
    would write, fused or not, reordered twice, and unpacked (the CUDA path) alike."""
    monkeypatch.setattr(packed_int4, "TILES_BLOCK_BYTES", 1)
    torch.manual_seed(0)
    gate, up = (_gptq_parts(3 * tile_rows, 256, act_order, 32, layout) for _ in range(2))
    up = replace(up, input_order=gate.input_order)  # one input, one Hessian: one order
    rows, again = torch.randperm(3 * tile_rows), torch.randperm(3 * tile_rows)
    moved = permute_rows(permute_rows(gate, rows), again)
    fused = concat([moved, permute_rows(up, rows)])
    assert isinstance(moved, Int4Words) and len(moved.orders()) == 1
    assert isinstance(fused, Int4Words) and len(fused.orders()) == 2
    for parts in (moved, fused):
        gathered = replace(parts, words=(parts.all_words(),), column_orders=())
        tiles = words_cpu_tiles(parts, tile_rows, compiled)
        assert torch.equal(tiles, words_cpu_tiles(gathered, tile_rows, compiled=False))
        assert torch.equal(tiles, _pack_cpu_tiles(unpack_words(parts).values, tile_rows))
    torch.testing.assert_close(dequantize(moved), dequantize(gate)[rows][again])
    fused_moved = permute_rows(fused, again.repeat(2)[: 6 * tile_rows])  # fused: gathered now
    assert isinstance(fused_moved, Int4Words) and fused_moved.column_orders == ()


@pytest.mark.parametrize(
    ("layout", "act_order"), [("gptq", False), ("gptq", True), ("ct", False), ("awq", False)]
)
@pytest.mark.parametrize("out_features", [128, 48])  # 48: no whole tile, packed by the op
def test_a_stored_int4_matrix_multiplies_as_its_dequantisation(
    layout: str, act_order: bool, out_features: int
) -> None:
    torch.manual_seed(0)
    parts = _gptq_parts(out_features, 256, act_order, group_size=32, layout=layout)
    stored = store(parts, "none", torch.bfloat16, CPU)
    assert isinstance(stored, PermutedWeight) == act_order
    x = torch.randn(3, 256).bfloat16()
    reference = x.float() @ dequantize(parts).t()
    got = stored.linear(x).float()
    torch.testing.assert_close(got, reference, rtol=0.02, atol=0.02 * reference.abs().max().item())


def _gptq_tensors(module: str, out_features: int, in_features: int, desc_act: bool) -> Read:
    group = 128  # GPTQ's group_size
    g_idx = torch.arange(in_features, dtype=torch.int32) // group
    tensors = {
        f"{module}.qweight": torch.randint(
            -(2**31), 2**31 - 1, (in_features // 8, out_features), dtype=torch.int32
        ),
        f"{module}.qzeros": torch.randint(
            -(2**31), 2**31 - 1, (in_features // group, out_features // 8), dtype=torch.int32
        ),
        f"{module}.scales": torch.rand(in_features // group, out_features).half(),
        f"{module}.g_idx": g_idx[torch.randperm(in_features)] if desc_act else g_idx,
    }
    return tensors.get


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_reads_its_outputs_in_the_order_asked(desc_act: bool) -> None:
    """act-order's fold: gate/up read with their outputs in down_proj's input order, gathered
    as qweight's packed words, dequantise to the checkpoint's rows in that order."""
    torch.manual_seed(0)
    quant = parse_quantization_config({"quantization_config": GPTQ | {"desc_act": desc_act}})
    read, rows = _gptq_tensors("m", 48, 256, desc_act), torch.randperm(48)
    asked = read_matrix(read, "m", quant, rows)
    assert isinstance(asked, Int4Words) and (asked.input_order is not None) == desc_act
    torch.testing.assert_close(
        dequantize(asked), dequantize(read_matrix(read, "m", quant))[rows], rtol=0, atol=0
    )
    with pytest.raises(ValueError, match="m has 48 outputs; cannot feed 47 inputs"):
        read_matrix(read, "m", quant, rows[:47])


def test_down_proj_gives_up_its_input_order_to_gate_up() -> None:
    """An act-order down_proj is stored without its permutation, which gate/up take on; any
    other keeps its own order."""
    torch.manual_seed(0)
    down = _gptq_parts(16, 24, act_order=True)
    folded, order = split_input_order(down)
    assert isinstance(folded, Int4Words) and folded.input_arrives_ordered
    assert order is not None and order is down.input_order
    unchanged, no_order = split_input_order(folded)
    assert unchanged is folded and no_order is None
    x = torch.randn(3, 24)  # the MLP's intermediate features, in the checkpoint's order
    torch.testing.assert_close(x[:, order] @ dequantize(folded).t(), x @ dequantize(down).t())


@pytest.fixture(scope="module")
def checkpoints() -> Callable[[str], Path]:
    return gptqmodel_checkpoint  # from the reference cache; `make test`'s set-up fills it


@pytest.fixture(scope="module")
def references() -> Callable[[Path], Any]:
    made: dict[Path, Any] = {}

    def get(path: Path) -> Any:
        if path not in made:
            made[path] = dequantized_model(path)
        return made[path]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matrices_equal_gptqmodels_dequantisation(
    checkpoints: Callable[[str], Path], variant: str
) -> None:
    """Every quantised matrix as the engine reads it (scale and zero rounded to bf16 for the
    kernels, the reference's are float16) equals GPTQModel's own dequantisation."""
    path = checkpoints(variant)
    cfg, reference = load_model_config(path), dequantized_state_dict(path)
    modules = sorted(n.removesuffix(".qweight") for n in _names(path) if n.endswith(".qweight"))
    assert len(modules) >= 16, "the checkpoint quantised too little"
    with open_weights(path) as read:
        for module in modules:
            ours = dequantize(read_matrix(read, module, cfg.checkpoint_quant))
            ref = reference[f"{module}.weight"]
            torch.testing.assert_close(ours, ref, rtol=0, atol=ref.abs().max().item() / 128)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_tensor_parallel_rank_reads_its_slice(
    checkpoints: Callable[[str], Path], variant: str
) -> None:
    """Each of two ranks' shares of qweight, qzeros, scales and g_idx reads as its slice of the
    whole matrix; act-order is refused under tensor parallelism, naming desc_act."""
    path = checkpoints(variant)
    quant = load_model_config(path).checkpoint_quant
    if bool(VARIANTS[variant].get("desc_act")):
        with pytest.raises(ValueError, match=r"act-order \(desc_act\)"):
            check_prequantized_parallel(quant, 2)
        return
    compared = assert_shards_read_as_slices(path)
    assert {"self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj"} <= set(compared)


def _names(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return set(handle.keys())


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_greedy_tokens_match_transformers(
    checkpoints: Callable[[str], Path],
    references: Callable[[Path], Any],
    make_engine: Callable[..., Engine],
    variant: str,
) -> None:
    path = checkpoints(variant)
    hf = references(path)
    for prompt, logits in zip(PROMPTS, our_logits(path, PROMPTS, [5]), strict=True):
        torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=LOGIT_TOLERANCE, rtol=0)
    engine = make_engine(path)
    model = engine.runner.model
    layer = model.layers[0]
    is_act_order = bool(VARIANTS[variant].get("desc_act")) and VARIANTS[variant]["group_size"] > 0
    packed = PermutedWeight if is_act_order else Int4Weight
    assert isinstance(layer.qkv.weight, packed)
    assert not isinstance(layer.down.weight, PermutedWeight)  # act-order folded into gate/up
    assert (layer.mlp_order is not None) == is_act_order
    # `lm_head: true`: the checkpoint's packed lm_head (its own scheme: dynamic.lm_head) beside
    # its (untied) bf16 embedding
    quant = load_model_config(path).checkpoint_quant
    head = quant.scheme_for("lm_head") if quant is not None else None
    assert (head is not None) == variant.endswith("-head")
    stored = DenseWeight if head is None else PermutedWeight if head.desc_act else Int4Weight
    assert (type(model.lm_head), type(model.embed)) == (stored, DenseWeight)
    ours = run_all(engine, PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    for index, prompt in enumerate(PROMPTS):
        assert_greedy_matches(hf, prompt, ours[str(index)])


@pytest.mark.slow
def test_lora_slots_put_back_the_checkpoints_mlp_order(
    checkpoints: Callable[[str], Path],
    references: Callable[[Path], Any],
    make_engine: Callable[..., Engine],
) -> None:
    """Adapters are trained on the checkpoint's order of the MLP's features: with LoRA slots a
    folded act-order MLP multiplies in that order again, and still answers as transformers."""
    path = checkpoints("gptq-g64-desc")
    engine = make_engine(path, enable_lora=True)
    layer = engine.runner.model.layers[0]
    assert layer.mlp_order is None and isinstance(layer.down.weight, PermutedWeight)
    cfg, mlp = load_model_config(path), "model.layers.0.mlp"
    with open_weights(path) as read:
        gate, up, down = (
            dequantize(read_matrix(read, f"{mlp}.{m}_proj", cfg.checkpoint_quant))
            for m in ("gate", "up", "down")
        )
    for linear, ref in ((layer.gate_up, torch.cat([gate, up])), (layer.down, down)):
        stored = linear.weight.dequantize(torch.float32)  # through the kernel: bf16 precision
        torch.testing.assert_close(stored, ref, rtol=0, atol=ref.abs().max().item() / 128)
    hf = references(path)
    ours = run_all(engine, PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    for index, prompt in enumerate(PROMPTS):
        assert ours[str(index)] == hf_greedy(hf, prompt, 12)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_perplexity_within_half_a_percent_of_transformers(
    checkpoints: Callable[[str], Path],
    references: Callable[[Path], Any],
    tiny_llama_dir: Path,
    variant: str,
) -> None:
    """The quality goal of issue 39 on models/tiny-llama/eval.txt, through the eval module."""
    path = checkpoints(variant)
    cfg = load_model_config(path)
    samples = samples_for("perplexity", tiny_llama_dir / "eval.txt", Tokenizer(path), 512)
    scores = score(load_model(path, cfg, "none", torch.float32, CPU), samples, CPU, None)
    ours = math.exp(scores.nll / scores.num_targets)
    reference = hf_perplexity(references(path), [s.ids for s in samples])
    assert abs(ours / reference - 1) < 0.005, (ours, reference)
