"""The child process of bench/reference/gptq_awq.py, run by GPTQModel's tool venv (never the
project's): writes one variant's checkpoint and its reference (see there). Its own module, with
nothing but what it writes, because the reference cache's key hashes this file: editing how
the cache is found or read does not make every variant be written again.

python -m bench.reference.gptq_awq_writer OUT VARIANT SOURCE
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

TINY_LLAMA = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"

VARIANTS: dict[str, dict[str, Any]] = {
    "gptq-g128": dict(method="gptq", group_size=128, desc_act=False, sym=True),
    "gptq-g64-desc": dict(method="gptq", group_size=64, desc_act=True, sym=True),
    "gptq-g32-asym-v2": dict(method="gptq", group_size=32, desc_act=False, sym=False, v2=True),
    "gptq-channel-desc": dict(method="gptq", group_size=-1, desc_act=True, sym=True),
    "awq-g64-zp": dict(method="awq", group_size=64, sym=False),  # zero_point: true
    "awq-g128": dict(method="awq", group_size=128, sym=True),  # zero_point: false
}
# bench.engine_prequant's: act-order at the engine's group size, and AWQ on every linear layer
# (for models whose features divide by 128).
BENCH_VARIANTS: dict[str, dict[str, Any]] = {
    "gptq-g128-desc": dict(method="gptq", group_size=128, desc_act=True, sym=True),
    "awq-g128-all": dict(method="awq", group_size=128, skip_mlp=False),
}
NUM_CALIBRATION_SAMPLES = 8


def _write(out: Path, variant: str, source: Path) -> None:
    timings: dict[str, float] = {}
    started = time.monotonic()
    import gptqmodel  # noqa: F401 - timed alone: torch, triton and torchao come with it

    timings["import"] = time.monotonic() - started
    _quantize(out / "checkpoint", variant, source, timings)
    mark = time.monotonic()
    from safetensors.torch import save_file

    save_file(_gptqmodel_dequantized(out / "checkpoint"), str(out / "reference.safetensors"))
    timings["dequantise reference"] = time.monotonic() - mark
    timings["total"] = time.monotonic() - started
    (out / "timings.json").write_text(json.dumps({k: round(v, 1) for k, v in timings.items()}))


def _quantize(out: Path, variant: str, source: Path, timings: dict[str, float]) -> None:
    from gptqmodel import AWQConfig, GPTQConfig, GPTQModel
    from gptqmodel.quantization import FORMAT

    spec = {**VARIANTS, **BENCH_VARIANTS}[variant]
    common = dict(bits=4, group_size=spec["group_size"], offload_to_disk=False, device="cpu")
    config: Any
    if spec["method"] == "gptq":
        fmt = FORMAT.GPTQ_V2 if spec.get("v2") else FORMAT.GPTQ
        config = GPTQConfig(**common, desc_act=spec["desc_act"], sym=spec["sym"], format=fmt)
    else:
        skips: dict[str, Any] | None = {r"-:.*mlp\..*": {}} if spec.get("skip_mlp", True) else None
        config = AWQConfig(**common, sym=spec.get("sym", True), dynamic=skips)
    paragraphs = (TINY_LLAMA / "eval.txt").read_text().split("\n\n")  # same tokenizer
    calibration = [p for p in paragraphs if len(p) > 200][:NUM_CALIBRATION_SAMPLES]
    mark = time.monotonic()
    model = GPTQModel.load(str(source), config)
    timings["load"], mark = time.monotonic() - mark, time.monotonic()
    model.quantize(calibration, batch_size=NUM_CALIBRATION_SAMPLES)
    timings["quantize"], mark = time.monotonic() - mark, time.monotonic()
    model.save(str(out))
    timings["save"] = time.monotonic() - mark
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)


def _gptqmodel_dequantized(checkpoint: Path) -> dict[str, Any]:
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    model = GPTQModel.load(str(checkpoint), device="cpu", backend=BACKEND.TORCH)
    state: dict[str, Any] = {}
    for name, module in model.model.named_modules():
        if not hasattr(module, "qweight"):
            continue
        if hasattr(module, "g_idx"):  # GPTQ: [in, out], g_idx and the v1 zero offset applied
            weight = module.dequantize_weight()
        else:
            args = (module.qweight, module.qzeros, module.scales, module.bits, module.group_size)
            weight = dequantize_gemm(*args)
        state[f"{name}.weight"] = weight.t().float().contiguous()
    for name, tensor in model.model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if f"{module}.weight" not in state and name.endswith(("weight", "bias")):
            state[name] = tensor.float().clone()  # clone: tied tensors saved apart
    return state


if __name__ == "__main__":
    _write(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
