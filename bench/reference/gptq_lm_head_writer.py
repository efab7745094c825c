"""The child process of bench/reference/gptq_awq.py for the GPTQ variants that quantise the lm_head
too (GPTQModel `lm_head=True`, config.json's `lm_head: true`), run by GPTQModel's tool venv as
gptq_awq_writer.py is, and writing the same two things (the checkpoint and GPTQModel's own
dequantised reference, the lm_head's included).

GPTQModel quantises the lm_head as a `dynamic` entry of its own says, by default 8 bits in groups
of 32 without act-order (its module_looper), which the engine has no packed kernel for (the
parser refuses it, naming `dynamic.lm_head.bits`); the variants give the entry: 4 bits, group 128,
no act-order (GPTQModel's default but for the bits and group), saved in config.json's `dynamic`.

GPTQModel refuses to quantise the lm_head of a model that ties it to the embedding
(NotImplementedError: "quantization of `lm_head` layer with `tied_weights=True` model state is
not supported"), and tiny-llama ties them; so the source is untied first, as a user would and as
llm-compressor does itself: the lm_head gets its own copy of the embedding's matrix and
config.json says `tie_word_embeddings: false`. The checkpoint then holds a bf16 embedding and a
packed lm_head.

Its own module so that adding these variants leaves the reference cache's key of the others (a
hash of gptq_awq_writer.py) as it was; the key of these hashes both files.

python -m bench.reference.gptq_lm_head_writer OUT VARIANT SOURCE
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.reference.gptq_awq_writer import (
    NUM_CALIBRATION_SAMPLES,
    TINY_LLAMA,
    _gptqmodel_dequantized,
)

VARIANTS: dict[str, dict[str, Any]] = {
    "gptq-g128-desc-head": dict(method="gptq", group_size=128, desc_act=True, sym=True),
}
# How the lm_head is quantised (GPTQModel's `dynamic` entry for it).
LM_HEAD_OVERRIDES: dict[str, dict[str, Any]] = {
    "gptq-g128-desc-head": dict(bits=4, group_size=128, sym=True, desc_act=False),
}


def _write(out: Path, variant: str, source: Path) -> None:
    timings: dict[str, float] = {}
    started = time.monotonic()
    import gptqmodel  # noqa: F401 - timed alone: torch, triton and torchao come with it

    timings["import"] = time.monotonic() - started
    mark = time.monotonic()
    untied = _untie(source, out / "untied")
    timings["untie"] = time.monotonic() - mark
    _quantize(out / "checkpoint", variant, untied, timings)
    shutil.rmtree(untied)
    mark = time.monotonic()
    from safetensors.torch import save_file

    save_file(_gptqmodel_dequantized(out / "checkpoint"), str(out / "reference.safetensors"))
    timings["dequantise reference"] = time.monotonic() - mark
    timings["total"] = time.monotonic() - started
    (out / "timings.json").write_text(json.dumps({k: round(v, 1) for k, v in timings.items()}))


def _untie(source: Path, out: Path) -> Path:
    """`source` saved again with its lm_head a copy of the embedding's matrix, untied."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    embedding = model.get_input_embeddings().weight.data
    model.get_output_embeddings().weight = torch.nn.Parameter(embedding.clone())
    model.config.tie_word_embeddings = False
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)
    return out


def _quantize(out: Path, variant: str, source: Path, timings: dict[str, float]) -> None:
    from gptqmodel import GPTQConfig, GPTQModel
    from gptqmodel.quantization import FORMAT

    spec = VARIANTS[variant]
    config = GPTQConfig(
        bits=4,
        group_size=spec["group_size"],
        desc_act=spec["desc_act"],
        sym=spec["sym"],
        format=FORMAT.GPTQ,
        lm_head=True,
        dynamic={"lm_head": LM_HEAD_OVERRIDES[variant]},
        offload_to_disk=False,
        device="cpu",
    )
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


if __name__ == "__main__":
    _write(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
