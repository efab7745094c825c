"""Pre-quantised tiny-llama checkpoints for the GPU check's `prequant` step, written here (the
GPU machine has no network and neither GPTQModel nor compressed-tensors) into `.gpu-refs/`, an
ignored folder the device call carries (`carry: [".gpu-refs"]`, about 19 MiB):

- GPTQ g64 act-order and AWQ g64 with zero points, as GPTQModel wrote them (its reference
  cache, bench/reference/gptq_awq.py; written first if missing);
- compressed-tensors int4 channel-wise and fp8 per channel (bench/reference/prequantized.py).

    python -m bench.gpu.prequant_refs [--out .gpu-refs]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from bench.reference import gptq_awq, prequantized

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / ".gpu-refs"
GPTQMODEL_VARIANTS = ("gptq-g64-desc", "awq-g64-zp")
COMPRESSED_TENSORS_VARIANTS = ("int4-channel", "fp8-channel")


def write_refs(out: Path) -> list[Path]:
    """Every checkpoint into its own folder under `out`, replacing what was there."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    written = []
    for variant in GPTQMODEL_VARIANTS:
        written.append(Path(shutil.copytree(gptq_awq.reference_checkpoint(variant), out / variant)))
    for variant in COMPRESSED_TENSORS_VARIANTS:
        written.append(prequantized.write_checkpoint(out / variant, variant))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for path in write_refs(args.out):
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        print(f"==> {path} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
