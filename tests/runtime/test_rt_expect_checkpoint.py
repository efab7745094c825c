"""--expect-checkpoint: a pod planned for one kind of checkpoint (from the config.json the operator
was given, spec.model.configMapRef) refuses at start to serve another, before any weight is
loaded, instead of quantising a 16-bit checkpoint itself where a calibrated one was planned."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.reference.models import TINY_LLAMA
from kvpilot.contract import checkpoint_quant
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.engine import Engine

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": False}


def compressed_tensors(weights: dict[str, Any], fmt: str) -> dict[str, Any]:
    group = {"targets": ["Linear"], "weights": weights}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


INT4 = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}
INT8 = {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True}
FP8 = {"type": "float", "num_bits": 8, "strategy": "channel"}


# quantization_config -> the kind --expect-checkpoint names; every kind is a flag choice.
@pytest.mark.parametrize(
    ("quantization_config", "kind"),
    [
        (None, "16-bit"),
        (AWQ, "awq-int4"),
        (GPTQ, "gptq-int4"),
        (compressed_tensors(INT4, "pack-quantized"), "compressed-tensors-int4"),
        (compressed_tensors(INT8, "naive-quantized"), "compressed-tensors-int8"),
        (compressed_tensors(FP8, "float-quantized"), "compressed-tensors-fp8"),
    ],
)
def test_each_checkpoint_has_one_kind(
    quantization_config: dict[str, Any] | None, kind: str
) -> None:
    config = {} if quantization_config is None else {"quantization_config": quantization_config}
    quant = checkpoint_quant.parse_quantization_config(config)
    assert checkpoint_quant.checkpoint_kind(quant) == kind
    assert kind in checkpoint_quant.CHECKPOINT_KINDS
    checkpoint_quant.check_expected_checkpoint(kind, quant)  # its own kind: accepted
    checkpoint_quant.check_expected_checkpoint(None, quant)  # not asked: accepted
    for other in set(checkpoint_quant.CHECKPOINT_KINDS) - {kind}:
        with pytest.raises(ValueError, match=f"--expect-checkpoint {other}: the checkpoint"):
            checkpoint_quant.check_expected_checkpoint(other, quant)


def test_a_kind_that_is_no_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="expect_checkpoint must be one of 16-bit, "):
        EngineConfig(model=str(TINY_LLAMA), expect_checkpoint="awq")


@pytest.fixture
def awq_config_dir(tmp_path: Path) -> Path:
    """tiny-llama's files with an AWQ quantization_config in its config.json (no packed
    tensors: the engine refuses before it reads a weight)."""
    for source in TINY_LLAMA.iterdir():
        (tmp_path / source.name).symlink_to(source)
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config | {"quantization_config": AWQ}))
    return tmp_path


@pytest.mark.parametrize(
    ("checkpoint", "quantization", "expected", "refusal"),
    [
        # planned as AWQ int4, the checkpoint is 16-bit: --quantization int4 alone would start
        # and quantise it at load
        ("tiny", "int4", "awq-int4", "the checkpoint at --model is 16-bit (no quantization_config"),
        # planned as 16-bit at int4, the checkpoint is AWQ (its own level: accepted alone)
        (
            "awq",
            "int4",
            "16-bit",
            "is awq-int4 (quantization_config awq int4 (awq-gemm, group 128",
        ),
        ("awq", "int4", "gptq-int4", "the checkpoint at --model is awq-int4"),
    ],
)
def test_the_engine_refuses_another_checkpoint_at_start(
    make_engine: Callable[..., Engine],
    awq_config_dir: Path,
    checkpoint: str,
    quantization: str,
    expected: str,
    refusal: str,
) -> None:
    path = TINY_LLAMA if checkpoint == "tiny" else awq_config_dir
    with pytest.raises(ValueError, match=f"--expect-checkpoint {expected}: ") as error:
        make_engine(path, quantization=quantization, expect_checkpoint=expected)
    assert refusal in str(error.value)
    assert "spec.model.configMapRef" in str(error.value)


def test_the_engine_starts_on_the_checkpoint_it_expects(make_engine: Callable[..., Engine]) -> None:
    assert make_engine(quantization="int4", expect_checkpoint="16-bit").weight_bytes > 0
