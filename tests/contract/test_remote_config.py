"""Parameters counted from safetensors headers alone, as the operator reads an S3 model."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from kvpilot.contract.remote_config import safetensors_parameters

TINY = Path(__file__).parents[2] / "models" / "tiny-llama" / "model.safetensors"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ({}, 0),
        ({"__metadata__": {"format": "pt"}}, 0),
        ({"a": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]}}, 32),
        ({"a": {"shape": [3]}, "b": {"shape": [2, 2, 2]}, "s": {"shape": []}}, 12),  # scalar: 1
    ],
)
def test_safetensors_parameters(header: dict[str, Any], expected: int) -> None:
    assert safetensors_parameters(header) == expected


def test_the_header_of_a_real_checkpoint_counts_what_safetensors_loads() -> None:
    raw = TINY.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    with safe_open(str(TINY), "pt") as f:
        loaded = sum(f.get_tensor(name).numel() for name in f.keys())  # noqa: SIM118
    assert safetensors_parameters(header) == loaded == 3_819_776
