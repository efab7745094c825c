"""The disk tier's block files: one block's KV per file, behind a header that says whose it is.

File: MAGIC, the header's length (4 bytes, little-endian), the header as JSON, the KV bytes.
The header carries the model identity (a digest of the checkpoint and of every setting that
changes the KV's values), the KV dtype, the block size, the layout (layers, KV heads, head
dim), the block's chained hash and tokens, and the SHA-256 of the KV bytes. A file is served
only when all of these match what the runtime asks for; anything else is a BlockFileError whose
message says why, which the tier logs once before it ignores the file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MAGIC = b"KVPILOT-KVBLOCK1"
HEADER_LEN_BYTES = 4
SUFFIX = ".kvblock"
# The weights' identity reads each checkpoint file's size and first and last MiB, not all of
# it: hashing gigabytes at every start would cost minutes, and two checkpoints that differ
# (a fine-tune, a requantisation) differ in their first tensors' bytes or in their sizes.
WEIGHT_SAMPLE_BYTES = 1 << 20


class BlockFileError(ValueError):
    """A block file that must not be served: what is wrong with it."""


@dataclass(frozen=True)
class BlockLayout:
    """What every block file of this runtime must match."""

    model_identity: str
    kv_dtype: str  # torch's name: float32, bfloat16, float8_e4m3fn, ...
    kv_itemsize: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def payload_shape(self) -> tuple[int, int, int, int, int]:
        """[layers, K/V, BLOCK_SIZE, H_kv, head_dim bytes]: the KV as raw bytes."""
        width = self.head_dim * self.kv_itemsize
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, width)

    @property
    def payload_bytes(self) -> int:
        layers, kv, block, heads, width = self.payload_shape
        return layers * kv * block * heads * width


def file_name(block_hash: int) -> str:
    return f"{block_hash:016x}{SUFFIX}"


def encode(layout: BlockLayout, block_hash: int, token_ids: tuple[int, ...], kv: bytes) -> bytes:
    header = {
        **asdict(layout),
        "hash": block_hash,
        "token_ids": list(token_ids),
        "sha256": hashlib.sha256(kv).hexdigest(),
    }
    header_bytes = json.dumps(header, sort_keys=True).encode()
    return MAGIC + len(header_bytes).to_bytes(HEADER_LEN_BYTES, "little") + header_bytes + kv


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header, offset of the KV bytes), reading the header only (index rebuild at start)."""
    with path.open("rb") as file:
        prefix = file.read(len(MAGIC) + HEADER_LEN_BYTES)
        if len(prefix) < len(MAGIC) + HEADER_LEN_BYTES or not prefix.startswith(MAGIC):
            raise BlockFileError("not a kvpilot block file (bad magic)")
        length = int.from_bytes(prefix[len(MAGIC) :], "little")
        try:
            header = json.loads(file.read(length))
        except (ValueError, UnicodeDecodeError) as error:
            raise BlockFileError(f"unreadable header ({error})") from None
    if not isinstance(header, dict):
        raise BlockFileError("unreadable header (not a JSON object)")
    return header, len(prefix) + length


def check_header(header: dict[str, Any], layout: BlockLayout) -> int:
    """The block's hash, when the header is this runtime's; BlockFileError naming the field
    that differs otherwise."""
    for name, expected in asdict(layout).items():
        if header.get(name) != expected:
            raise BlockFileError(f"{name} is {header.get(name)!r}, this runtime has {expected!r}")
    block_hash = header.get("hash")
    if not isinstance(block_hash, int) or not isinstance(header.get("token_ids"), list):
        raise BlockFileError("header lacks the block's hash or tokens")
    return block_hash


def decode(data: bytes, layout: BlockLayout, block_hash: int, token_ids: tuple[int, ...]) -> bytes:
    """The KV bytes of a whole file read back, checked against the header, the layout, the
    block asked for and the checksum."""
    if not data.startswith(MAGIC):
        raise BlockFileError("not a kvpilot block file (bad magic)")
    start = len(MAGIC) + HEADER_LEN_BYTES
    length = int.from_bytes(data[len(MAGIC) : start], "little")
    try:
        header = json.loads(data[start : start + length])
    except (ValueError, UnicodeDecodeError) as error:
        raise BlockFileError(f"unreadable header ({error})") from None
    if not isinstance(header, dict) or check_header(header, layout) != block_hash:
        raise BlockFileError("holds another block's hash")
    if tuple(header["token_ids"]) != token_ids:
        raise BlockFileError("holds other tokens under this hash")
    kv = data[start + length :]
    if len(kv) != layout.payload_bytes or hashlib.sha256(kv).hexdigest() != header.get("sha256"):
        raise BlockFileError("KV bytes do not match the header's checksum (corrupt)")
    return kv


def model_identity(model_dir: Path, settings: dict[str, Any]) -> str:
    """A digest of the checkpoint (config.json whole; each weight file's name, size and first
    and last MiB) and of the settings that change the KV's values (dtype, quantisation, ...)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    digest.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as file:
            digest.update(file.read(WEIGHT_SAMPLE_BYTES))
            file.seek(max(0, size - WEIGHT_SAMPLE_BYTES))
            digest.update(file.read(WEIGHT_SAMPLE_BYTES))
    return "sha256:" + digest.hexdigest()
