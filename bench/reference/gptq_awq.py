"""GPTQ and AWQ tiny-llama checkpoints written by GPTQModel itself, and their reference.

GPTQModel (the maintained successor of AutoGPTQ and AutoAWQ; it quantises on CPU) is not a
dependency of the project: it runs in a tool venv of its own (hack/gptq_tools.sh, cached under
~/.cache/kvpilot/tools by version), in a child process, and never in the project's venv. The
child (bench/reference/gptq_awq_writer.py) writes, per variant, the checkpoint and the reference:

- `checkpoint/`: GPTQ with its Hessian-based rounding, act-order or not, or AWQ with its
  activation-aware scale search, calibrated on paragraphs of models/tiny-llama/eval.txt, saved
  with config.json's `quantization_config` as GPTQModel writes it;
- `reference.safetensors`: every tensor of that checkpoint with each quantised matrix [out, in]
  dequantised (float32) by GPTQModel's own pure-torch modules (`TorchLinear.dequantize_weight`,
  AWQ's `dequantize_gemm`). Nothing of kvpilot's reader is used on either side.

Both are written once per (GPTQModel's pinned requirements, the writer, the source model) into
~/.cache/kvpilot/gptq-refs/<key>/<variant>/, atomically (a temporary directory renamed into
place), so the tests and the benchmark read them from there.

AWQ's scale and clip search needs each layer's input and output features to divide by 64,
which tiny-llama's MLP (688 features) does not: the AWQ variants quantise attention only (a
GPTQModel `-:` dynamic skip), the MLP stays 16-bit. The `-head` variants quantise the lm_head too,
the model untied first (bench/reference/gptq_lm_head_writer.py says why); their key hashes that
writer as well.

python -m bench.reference.gptq_awq [VARIANT...]   # fills the cache (make test's set-up)
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from bench.reference import gptq_awq_writer, gptq_lm_head_writer
from bench.reference.gptq_awq_writer import BENCH_VARIANTS

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = ROOT / "models" / "tiny-llama"  # bench.reference.models's, without importing kvpilot
TOOL_SCRIPT = ROOT / "hack" / "gptq_tools.sh"
TOOL_PINS = ROOT / "hack" / "gptq-requirements.txt"
WRITER = Path(__file__).with_name("gptq_awq_writer.py")
HEAD_WRITER = Path(__file__).with_name("gptq_lm_head_writer.py")
# The tests' variants (tiny-llama), those that quantise the lm_head too included.
VARIANTS = {**gptq_awq_writer.VARIANTS, **gptq_lm_head_writer.VARIANTS}


def writer_files(variant: str) -> list[Path]:
    """The writer modules that write `variant`, the child process's first."""
    return [WRITER, HEAD_WRITER] if variant in gptq_lm_head_writer.VARIANTS else [WRITER]


CALIBRATION_TEXT = TINY_LLAMA / "eval.txt"  # what the writer calibrates on, whatever the model

WRITE_TIMEOUT_S = 3600  # AWQ of the compute-bound model (bench.engine_prequant): 34 min on 2 cores


class GptqToolUnavailableError(RuntimeError):
    """GPTQModel's tool venv could not be made (e.g. no network to PyPI on a cold cache)."""


def cache_root() -> Path:
    return Path(os.environ.get("KVPILOT_CACHE_DIR", Path.home() / ".cache" / "kvpilot"))


def reference_key(source: Path, writers: list[Path] | None = None) -> str:
    """GPTQModel's pinned requirements, the writers (default: gptq_awq_writer.py alone), its
    calibration text (tiny-llama's, also for bench.engine_prequant's other model) and every
    file of the source model."""
    digest = hashlib.sha256()
    model_files = sorted(p for p in source.iterdir() if p.is_file())
    for path in [TOOL_PINS, *(writers or [WRITER]), CALIBRATION_TEXT, *model_files]:
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def reference_checkpoint(variant: str, source: Path = TINY_LLAMA) -> Path:
    """The checkpoint GPTQModel wrote for `variant` of `source` (its reference.safetensors
    beside it), from the cache, written first if missing. Raises GptqToolUnavailableError when
    the tool venv cannot be made; a failure of GPTQModel itself raises RuntimeError."""
    if variant not in VARIANTS and variant not in BENCH_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {_all_variants()}")
    key = reference_key(source, writer_files(variant))
    parent = cache_root() / "gptq-refs" / f"{source.name}-{key}"
    done = parent / variant
    if not done.is_dir():
        parent.mkdir(parents=True, exist_ok=True)
        with (parent / f"{variant}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another run writing it now: wait, then reuse it
            if not done.is_dir():
                _write_into_cache(done, variant, source)
    return done / "checkpoint"


def _write_into_cache(done: Path, variant: str, source: Path) -> None:
    python = tool_python()
    scratch = Path(tempfile.mkdtemp(prefix=f".{variant}-", dir=done.parent))
    scratch.chmod(0o755)  # mkdtemp's 0700 would stay on the cached variant
    try:
        print(f"==> GPTQModel writes {variant} of {source.name} into {done}", file=sys.stderr)
        started = time.monotonic()
        env = {**os.environ, "GPTQMODEL_CPU_WORKERS": "2", "CUDA_VISIBLE_DEVICES": ""}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        writer = f"bench.reference.{writer_files(variant)[-1].stem}"
        command = [python, "-m", writer, str(scratch), variant]
        ran = subprocess.run(  # in scratch: GPTQModel writes its logs/ into the working directory
            [*command, str(source)], cwd=scratch, env=env, capture_output=True, text=True,
            check=False, timeout=WRITE_TIMEOUT_S,
        )  # fmt: skip
        if ran.returncode != 0:
            raise RuntimeError(f"GPTQModel failed to write {variant}:\n{ran.stderr[-4000:]}")
        shutil.rmtree(scratch / "logs", ignore_errors=True)
        os.rename(scratch, done)  # atomic: a reader sees the whole variant or none of it
        print(f"==> {variant} written in {time.monotonic() - started:.0f}s", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


_tool_failed: list[
    GptqToolUnavailableError
] = []  # once per process: offline, every test skips at once


def tool_python() -> str:
    """hack/gptq_tools.sh's python (it makes the tool venv the first time, its progress lines
    passed on as they come)."""
    if _tool_failed:
        raise _tool_failed[0]
    script = subprocess.Popen(
        ["bash", str(TOOL_SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert script.stdout is not None and script.stderr is not None
    tail: deque[str] = deque(maxlen=15)
    for line in script.stderr:
        sys.stderr.write(line)
        tail.append(line)
    python = script.stdout.read().strip()  # one line: stdout cannot fill its pipe meanwhile
    if script.wait() != 0:
        _tool_failed.append(
            GptqToolUnavailableError(
                f"GPTQModel's tool venv could not be made (hack/gptq_tools.sh exited "
                f"{script.returncode}; it needs PyPI the first time):\n{''.join(tail)}"
            )
        )
        raise _tool_failed[0]
    return python


def dequantized_state_dict(checkpoint: Path) -> dict[str, Any]:
    """Every tensor of the checkpoint, each quantised module's weight [out, in] dequantised by
    GPTQModel's own pure-torch modules (float32), as the tool venv saved it."""
    from safetensors.torch import load_file

    reference = checkpoint.parent / "reference.safetensors"
    if not reference.is_file():
        raise FileNotFoundError(f"{reference}: not written; use reference_checkpoint(variant)")
    return load_file(str(reference))


def dequantized_model(checkpoint: Path) -> Any:
    """transformers' Llama (float32) on GPTQModel's dequantised weights, tied as the checkpoint
    says (the `-head` variants' are not)."""
    import json

    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(TINY_LLAMA)
    tied = json.loads((checkpoint / "config.json").read_text()).get("tie_word_embeddings", False)
    config.tie_word_embeddings = tied
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(dequantized_state_dict(checkpoint), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
        raise ValueError(f"reference: missing {missing}, unexpected {unexpected}")
    if tied:  # the lm_head is the embedding's matrix
        model.tie_weights()
    return model.float().eval()


def _all_variants() -> str:
    return ", ".join([*VARIANTS, *BENCH_VARIANTS])


def main(argv: list[str]) -> int:
    if unknown := set(argv) - set(VARIANTS) - set(BENCH_VARIANTS):
        print(f"unknown variants {sorted(unknown)}; choose from {_all_variants()}", file=sys.stderr)
        return 2
    try:
        for variant in argv or list(VARIANTS):
            print(f"==> {variant}: {reference_checkpoint(variant).parent}", file=sys.stderr)
    except GptqToolUnavailableError as error:  # the tests that need them skip, saying the same
        why = str(error).splitlines()[0]  # the script's own lines were printed as they came
        print(f"==> (GPTQ/AWQ references not built, their tests skip: {why})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
