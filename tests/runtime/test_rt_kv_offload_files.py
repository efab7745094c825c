"""The disk tier's block files (engine/kv_offload_files.py, kv_offload_disk.py): a file that is
not this runtime's, or is corrupt, is ignored with a log line and never served."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvpilot.runtime.engine import kv_offload_files as files
from kvpilot.runtime.engine.kv_offload_disk import DiskTier
from kvpilot.runtime.engine.stats import KvOffloadCounts

LAYOUT = files.BlockLayout(
    model_identity="sha256:abc", kv_dtype="bfloat16", kv_itemsize=2, block_size=16,
    num_layers=2, num_kv_heads=2, head_dim=8,
)  # fmt: skip
TOKENS = tuple(range(16))
HASH = 0x1234


def kv_bytes(seed: int = 0) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (LAYOUT.payload_bytes,), generator=generator)
        .to(torch.uint8)
        .numpy()
        .tobytes()
    )


def flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def test_a_block_file_round_trips() -> None:
    kv = kv_bytes()
    assert files.decode(files.encode(LAYOUT, HASH, TOKENS, kv), LAYOUT, HASH, TOKENS) == kv


@pytest.mark.parametrize(
    ("written_by", "change", "message"),
    [
        ({"model_identity": "sha256:other"}, None, "model_identity is 'sha256:other'"),
        ({"kv_dtype": "float8_e4m3fn", "kv_itemsize": 1}, None, "kv_dtype is 'float8_e4m3fn'"),
        ({"block_size": 32}, None, "block_size is 32"),
        ({"num_layers": 3}, None, "num_layers is 3"),
        ({"num_kv_heads": 4}, None, "num_kv_heads is 4"),
        ({"head_dim": 16}, None, "head_dim is 16"),
        ({}, flip_last_byte, "checksum"),
        ({}, lambda data: data[:-10], "checksum"),
        ({}, lambda data: b"GARBAGE" + data, "bad magic"),
        ({}, lambda data: data[:21] + b"\xff" + data[22:], "unreadable header"),
    ],
)
def test_a_file_that_does_not_match_is_refused(
    written_by: dict[str, object], change: Callable[[bytes], bytes] | None, message: str
) -> None:
    other = dataclasses.replace(LAYOUT, **written_by)  # type: ignore[arg-type]
    data = files.encode(other, HASH, TOKENS, kv_bytes()[: other.payload_bytes])
    data = change(data) if change is not None else data
    with pytest.raises(files.BlockFileError, match=message):
        files.decode(data, LAYOUT, HASH, TOKENS)


def test_a_file_under_another_block_is_refused() -> None:
    data = files.encode(LAYOUT, HASH, TOKENS, kv_bytes())
    with pytest.raises(files.BlockFileError, match="another block's hash"):
        files.decode(data, LAYOUT, HASH + 1, TOKENS)
    with pytest.raises(files.BlockFileError, match="other tokens"):
        files.decode(data, LAYOUT, HASH, tuple(range(1, 17)))


def write_block(directory: Path, block_hash: int, kv: bytes) -> None:
    tier = DiskTier(directory, 8, LAYOUT, KvOffloadCounts())
    data = torch.frombuffer(bytearray(kv), dtype=torch.uint8).view(LAYOUT.payload_shape)
    assert tier.admit(block_hash, 0)
    tier.write(block_hash, TOKENS, data, 0)
    tier.close()  # the writer thread finishes the queue first


def test_a_restarted_tier_indexes_its_files_and_ignores_others_with_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kv = kv_bytes(1)
    write_block(tmp_path, HASH, kv)
    other_model = dataclasses.replace(LAYOUT, model_identity="sha256:other")
    (tmp_path / files.file_name(7)).write_bytes(files.encode(other_model, 7, TOKENS, kv))
    (tmp_path / files.file_name(8)).write_bytes(b"not a block")
    with caplog.at_level(logging.WARNING, logger="kvpilot.kv_offload"):
        counts = KvOffloadCounts()
        tier = DiskTier(tmp_path, 8, LAYOUT, counts)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert any(files.file_name(7) in w and "model_identity" in w for w in warnings)
    assert any(files.file_name(8) in w and "bad magic" in w for w in warnings)
    assert counts.blocks["disk"] == 1
    assert tier.fetch(7, TOKENS) is None and tier.fetch(8, TOKENS) is None
    got = tier.fetch(HASH, TOKENS)
    assert got is not None and got.numpy().tobytes() == kv
    assert counts.bytes["disk_to_host"] == len(kv)
    tier.close()


def test_a_file_corrupted_after_indexing_is_not_served_and_is_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_block(tmp_path, HASH, kv_bytes(2))
    tier = DiskTier(tmp_path, 8, LAYOUT, KvOffloadCounts())
    path = tmp_path / files.file_name(HASH)
    path.write_bytes(flip_last_byte(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="kvpilot.kv_offload"):
        assert tier.fetch(HASH, TOKENS) is None
    assert [r.getMessage() for r in caplog.records if "checksum" in r.getMessage()]
    assert not path.exists() and HASH not in tier.index
    tier.close()


def test_the_disk_budget_keeps_the_newest_files(tmp_path: Path) -> None:
    for block_hash in (1, 2, 3):
        write_block(tmp_path, block_hash, kv_bytes(block_hash))
    tier = DiskTier(tmp_path, 2, LAYOUT, KvOffloadCounts())
    assert sorted(tmp_path.glob("*.kvblock")) == [tmp_path / files.file_name(h) for h in (2, 3)]
    assert 1 not in tier.index
    tier.close()
