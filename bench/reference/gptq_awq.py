"""GPTQ and AWQ tiny-llama checkpoints written by GPTQModel itself, and their reference.

`write_checkpoint` runs GPTQModel (the maintained successor of AutoGPTQ and AutoAWQ; it
quantises on CPU) in a child process: GPTQ with its Hessian-based rounding, act-order or not,
and AWQ with its activation-aware scale search, calibrated on paragraphs of
models/tiny-llama/eval.txt, saved with config.json's `quantization_config` as GPTQModel writes it.
`dequantized_model` is the reference: the same checkpoint loaded by GPTQModel's pure-torch
modules, each matrix dequantised by GPTQModel's own code (`TorchLinear.dequantize_weight`,
AWQ's `dequantize_gemm`) into transformers' Llama in float32. Nothing of kvpilot's reader is
used on either side.

AWQ's scale and clip search needs each layer's input and output features to divide by 64,
which tiny-llama's MLP (688 features) does not: the AWQ variants quantise attention only (a
GPTQModel `-:` dynamic skip), the MLP stays 16-bit.

python -m bench.reference.gptq_awq OUT VARIANT   # writes one checkpoint (the child process)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bench.reference.models import TINY_LLAMA

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


def is_available() -> bool:
    try:
        import gptqmodel  # noqa: F401
    except ImportError:
        return False
    return True


def write_checkpoint(out: Path, variant: str, source: Path = TINY_LLAMA) -> Path:
    """GPTQModel in a child process: its thread pools and logging stay out of the caller."""
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": "2", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = path
    command = [sys.executable, "-m", "bench.reference.gptq_awq", str(out), variant, str(source)]
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(  # in `out`: GPTQModel writes its logs/ into the working directory
        command, check=False, cwd=out, env=env, capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        raise RuntimeError(f"GPTQModel failed to write {variant}:\n{done.stderr[-4000:]}")
    return out


def _quantize(out: Path, variant: str, source: Path) -> None:
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
    model = GPTQModel.load(str(source), config)
    model.quantize(calibration, batch_size=NUM_CALIBRATION_SAMPLES)
    model.save(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)


def dequantized_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, each quantised module's weight [out, in] dequantised by
    GPTQModel's own pure-torch modules (float32)."""
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    model = GPTQModel.load(str(checkpoint), device="cpu", backend=BACKEND.TORCH)
    state: dict[str, torch.Tensor] = {}
    for name, module in model.model.named_modules():
        if not hasattr(module, "qweight"):
            continue
        if hasattr(module, "g_idx"):  # GPTQ: [in, out], g_idx and the v1 zero offset applied
            weight = module.dequantize_weight()
        else:
            args = (module.qweight, module.qzeros, module.scales, module.bits, module.group_size)
            weight = dequantize_gemm(*args)
        state[f"{name}.weight"] = weight.t().float()
    for name, tensor in model.model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if f"{module}.weight" not in state and name.endswith(("weight", "bias")):
            state[name] = tensor.float()
    return state


def dequantized_model(checkpoint: Path) -> Any:
    """transformers' Llama (float32) on GPTQModel's dequantised weights."""
    from transformers import AutoConfig, LlamaForCausalLM

    model = LlamaForCausalLM(AutoConfig.from_pretrained(TINY_LLAMA))
    missing, unexpected = model.load_state_dict(dequantized_state_dict(checkpoint), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head: tied to the embedding
        raise ValueError(f"reference: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.float().eval()


if __name__ == "__main__":
    _quantize(
        Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]) if len(sys.argv) > 3 else TINY_LLAMA
    )
