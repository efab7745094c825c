"""Pre-quantised checkpoints (compressed-tensors): the config checked and refused field by field,
the packed tensors read bit for bit, and tiny-llama quantised by compressed-tensors itself run
against transformers on the same checkpoint decompressed (logits, greedy tokens, perplexity)."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.reference.models import hf_logits, our_logits, run_all
from bench.reference.prequantized import (
    TINY_LLAMA_VARIANTS,
    decompressed_model,
    decompressed_state_dict,
    write_checkpoint,
)
from kvpilot.contract.checkpoint_quant import (
    parse_quantization_config,
    resolve_quantization,
)
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.model_runner import load_model
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.evaluate import samples_for, score
from kvpilot.runtime.layers.prequant import dequantize, read_matrix, unpack_int32
from kvpilot.runtime.layers.quant import DenseWeight, Int4Weight, Int8DynamicWeight, Int8Weight
from kvpilot.runtime.models.loader import load_model_config, open_weights
from kvpilot.runtime.models.tokenizer_files import Tokenizer
from tests.support.prequant_reference import (
    LOGIT_TOLERANCE,
    PROMPTS,
    assert_greedy_matches,
    assert_shards_read_as_slices,
    hf_perplexity,
)

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

CPU = torch.device("cpu")

INT4_G128 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                        "symmetric": True, "dynamic": False, "actorder": None},
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "sparsity_config": {},
    "transform_config": {},
}  # fmt: skip


def with_changes(changes: dict[str, Any]) -> dict[str, Any]:
    """INT4_G128 with dotted paths set (`config_groups.group_0.weights.num_bits`)."""
    qc = copy.deepcopy(INT4_G128)
    for path, value in changes.items():
        *parents, last = path.split(".")
        node: Any = qc
        for key in parents:
            node = node[key]
        node[last] = value
    return qc


W = "config_groups.group_0.weights"


@pytest.mark.parametrize(
    ("changes", "described", "level"),
    [
        ({}, "compressed-tensors int4 (pack-quantized, group 128)", "int4"),
        ({f"{W}.group_size": 32, f"{W}.symmetric": False}, "group 32, asymmetric", "int4"),
        ({f"{W}.strategy": "channel", f"{W}.group_size": None}, "int4 (pack-quantized, channel)",
         "int4"),
        ({f"{W}.num_bits": 8, f"{W}.strategy": "channel"}, "int8 (pack-quantized, channel)",
         "int8"),
        ({f"{W}.type": "float", f"{W}.num_bits": 8, f"{W}.strategy": "tensor",
          "format": "float-quantized",
          "config_groups.group_0.input_activations": {"type": "float", "num_bits": 8,
                                                      "dynamic": True}},
         "fp8 (float-quantized, tensor)", "none"),
    ],
)  # fmt: skip
def test_supported_configs(changes: dict[str, Any], described: str, level: str) -> None:
    quant = parse_quantization_config({"quantization_config": with_changes(changes)})
    assert quant is not None and described in quant.describe() and quant.level == level


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"quant_method": "bitsandbytes"},
         'quantization_config.quant_method: "bitsandbytes" is not supported; supported: '
         "compressed-tensors, gptq, awq"),
        ({f"{W}.num_bits": 3}, f"{W}.num_bits: 3 is not supported; supported: 4, 8"),
        ({f"{W}.group_size": 256}, f"{W}.group_size: 256 is not supported; supported: 32, 64, 128"),
        ({f"{W}.actorder": "group"}, f'{W}.actorder: "group" is not supported'),
        ({f"{W}.strategy": "block"}, f'{W}.strategy: "block" is not supported'),
        ({"format": "marlin-24"}, 'config_groups.group_0.format: "marlin-24" is not supported'),
        ({f"{W}.num_bits": 8, f"{W}.strategy": "channel", f"{W}.symmetric": False},
         f"{W}.symmetric: False is not supported"),
        ({"config_groups.group_0.input_activations": {"type": "int", "num_bits": 8}},
         "input_activations: quantised activations with int weights are not supported"),
        ({"kv_cache_scheme": {"num_bits": 8}}, "quantization_config.kv_cache_scheme: "),
        ({"config_groups.group_0.output_activations": {"num_bits": 8}}, "output_activations"),
        ({"quantization_status": "frozen"}, 'quantization_status: "frozen" is not supported'),
        ({"config_groups": {}}, "config_groups is empty"),
    ],
)  # fmt: skip
def test_refused_configs_name_the_field(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_quantization_config({"quantization_config": with_changes(changes)})
    assert message in str(error.value)


def test_sixteen_bit_checkpoint_has_no_quantization() -> None:
    assert parse_quantization_config({"architectures": ["LlamaForCausalLM"]}) is None


@pytest.mark.parametrize(
    ("flag", "expected"), [("none", "none"), ("int4", "none"), ("int8", None), ("bf16", None)]
)
def test_the_checkpoints_method_wins_and_a_conflicting_flag_is_refused(
    flag: str, expected: str | None
) -> None:
    quant = parse_quantization_config({"quantization_config": INT4_G128})
    assert resolve_quantization(flag, None) == flag
    if expected is not None:
        assert resolve_quantization(flag, quant) == expected
        return
    with pytest.raises(ValueError, match=f"--quantization {flag} conflicts with the checkpoint"):
        resolve_quantization(flag, quant)


@pytest.mark.parametrize(("num_bits", "num_values"), [(4, 256), (4, 300), (8, 256), (8, 690)])
def test_unpack_equals_compressed_tensors_packing(num_bits: int, num_values: int) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    torch.manual_seed(num_values)
    half = 1 << (num_bits - 1)
    values = torch.randint(-half, half, (6, num_values), dtype=torch.int8)
    unpacked = unpack_int32(pack_to_int32(values, num_bits), num_bits, num_values)
    assert unpacked.dtype == torch.uint8  # bytes: a quarter of int32's copies at load
    assert torch.equal(unpacked.to(torch.int32) - half, values.to(torch.int32))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = write_checkpoint(tmp_path_factory.mktemp(variant), variant)
        return made[variant]

    return get


@pytest.mark.parametrize("variant", TINY_LLAMA_VARIANTS)
def test_matrices_equal_compressed_tensors_decompression(
    checkpoints: Callable[[str], Path], variant: str
) -> None:
    """Every quantised matrix as the engine reads it (scale and zero rounded to bf16 for the
    kernels) equals compressed-tensors' own decompression, to bf16 precision."""
    path = checkpoints(variant)
    cfg, reference = load_model_config(path), decompressed_state_dict(path)
    modules = sorted(n.removesuffix(".weight_scale") for n in _names(path) if "_scale" in n)
    assert modules, "the checkpoint quantised nothing"
    with open_weights(path) as read:
        for module in modules:
            ours = dequantize(read_matrix(read, module, cfg.checkpoint_quant))
            ref = reference[f"{module}.weight"].float()
            torch.testing.assert_close(ours, ref, rtol=0, atol=ref.abs().max().item() / 64)


def _names(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return set(handle.keys())


EXPECTED_STORAGE: dict[str, tuple[type, ...]] = {
    "fp8": (DenseWeight,),  # dequantised once at load (layers/prequant.py says why)
    "int4": (Int4Weight,),
    "int8": (Int8Weight, Int8DynamicWeight),  # w8a8 where the CPU has int8 dot products
}


@pytest.mark.parametrize("variant", TINY_LLAMA_VARIANTS)
def test_logits_and_greedy_tokens_match_transformers(
    checkpoints: Callable[[str], Path], make_engine: Callable[..., Engine], variant: str
) -> None:
    path = checkpoints(variant)
    hf = decompressed_model(path)
    for prompt, logits in zip(PROMPTS, our_logits(path, PROMPTS, [5]), strict=True):
        torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=LOGIT_TOLERANCE, rtol=0)
    engine = make_engine(path)
    stored = engine.runner.model.layers[0].qkv.weight
    assert isinstance(stored, EXPECTED_STORAGE[variant.split("-", maxsplit=1)[0]])  # kept packed
    ours = run_all(engine, PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    for index, prompt in enumerate(PROMPTS):
        assert_greedy_matches(hf, prompt, ours[str(index)])


@pytest.mark.parametrize(
    "variant",
    [
        "fp8-channel",
        "int4-g128",
        "int4-g32-asym",
        "int8-channel",
        "int4-channel-head",
        "int4-g32-asym-head",
    ],
)
def test_perplexity_within_half_a_percent_of_transformers(
    checkpoints: Callable[[str], Path], tiny_llama_dir: Path, variant: str
) -> None:
    """The quality goal of issue 39 on models/tiny-llama/eval.txt, through the eval module."""
    path = checkpoints(variant)
    cfg = load_model_config(path)
    samples = samples_for("perplexity", tiny_llama_dir / "eval.txt", Tokenizer(path), 512)
    scores = score(load_model(path, cfg, "none", torch.float32, CPU), samples, CPU, None)
    ours = math.exp(scores.nll / scores.num_targets)
    reference = hf_perplexity(decompressed_model(path), [s.ids for s in samples])
    assert abs(ours / reference - 1) < 0.005, (ours, reference)


def linear_bytes(engine: Engine) -> int:
    model = engine.runner.model
    return sum(
        lin.weight.num_bytes()
        for layer in model.layers
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    )


def test_int4_checkpoint_is_packed_as_the_int4_level_packs(
    checkpoints: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> None:
    """Weights stay packed: a checkpoint quantising every linear layer channel-wise (one scale
    repeated per group of 128) holds exactly the bytes of the engine's own int4 level, a
    quarter of bf16's and then some for the scales."""
    own_int4 = linear_bytes(make_engine(quantization="int4"))
    assert linear_bytes(make_engine(checkpoints("int4-channel"))) == own_int4
    assert own_int4 < 0.3 * linear_bytes(make_engine(quantization="bf16"))


@pytest.mark.parametrize(
    ("variant", "stored"),
    [("int4-channel-head", Int4Weight), ("int8-channel-head", (Int8Weight, Int8DynamicWeight))],
)
def test_a_quantised_lm_head_is_served_packed_beside_a_16_bit_embedding(
    checkpoints: Callable[[str], Path],
    make_engine: Callable[..., Engine],
    variant: str,
    stored: type | tuple[type, ...],
) -> None:
    """The checkpoint's lm_head as stored (its packed tensors, not the embedding's matrix), the
    embedding it unties from kept 16-bit, as the checkpoint holds them both."""
    model = make_engine(checkpoints(variant)).runner.model
    assert isinstance(model.lm_head, stored) and isinstance(model.embed, DenseWeight)
    assert model.lm_head is not model.embed
    bf16_head = model.embed.num_bytes()  # the same [vocab, hidden] matrix at 2 bytes
    assert model.lm_head.num_bytes() < (0.55 if "int8" in variant else 0.3) * bf16_head


def test_a_tied_model_with_a_quantised_lm_head_is_refused(
    checkpoints: Callable[[str], Path], tmp_path: Path, make_engine: Callable[..., Engine]
) -> None:
    """The lm_head-quantised checkpoint said to be tied (as compressed-tensors' ModelCompressor
    saves a tied model it was not told to untie): which matrix the logits use is not said, so
    it is refused before any weight is read, naming the field."""
    source = checkpoints("int4-channel-head")
    for name in source.iterdir():
        (tmp_path / name.name).write_bytes(name.read_bytes())
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    with pytest.raises(ValueError, match=r"quantization_config.ignore: \[\] quantises lm_head"):
        make_engine(tmp_path)


def test_engine_refuses_a_conflicting_flag_and_tensor_parallelism(
    checkpoints: Callable[[str], Path], make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    path = checkpoints("int4-g128")
    with pytest.raises(ValueError, match="--quantization int8 conflicts with the checkpoint"):
        make_engine(path, quantization="int8")
    # down_proj quantised in groups of 128 too (as its config says; refused before any tensor
    # is read): its 688 inputs split in 344 a rank, which cuts a group
    for name in path.iterdir():
        (tmp_path / name.name).write_bytes(name.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp.down_proj has 688 input features, 344 a rank"):
        make_engine(tmp_path, tensor_parallel_size=2)
    assert make_engine(path, quantization="int4").weight_bytes > 0  # its own level: accepted


@pytest.mark.parametrize("variant", TINY_LLAMA_VARIANTS)
def test_each_tensor_parallel_rank_reads_its_slice(
    checkpoints: Callable[[str], Path], variant: str
) -> None:
    """Each of two ranks' shares of weight_packed, weight_scale, weight_zero_point and
    weight_shape (fp8 and int8 scales too) reads as its slice of the whole matrix."""
    compared = assert_shards_read_as_slices(checkpoints(variant))
    assert {"self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj"} <= set(compared)


def test_unsupported_config_is_refused_before_loading(
    checkpoints: Callable[[str], Path], tmp_path: Path, make_engine: Callable[..., Engine]
) -> None:
    """The issue's case: a scheme the loader does not read is never served with its scales
    ignored."""
    source = checkpoints("fp8-channel")
    for name in source.iterdir():
        (tmp_path / name.name).write_bytes(name.read_bytes())
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "block"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r'weights\.strategy: "block" is not supported'):
        make_engine(tmp_path)
