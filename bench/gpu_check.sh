#!/usr/bin/env bash
# GPU checks for a lent device machine (no network), about 3-5 minutes on one H200, 8 at most
# (and up to 7 more for step 4 where FlashInfer is carried: its first kernel compile):
#   1. python -m bench.gpu.check: logits and greedy tokens against transformers on the same GPU
#      for quantisation none/bf16/int8/int4 (float32) and none (bfloat16); fp8 KV (pool blocks,
#      greedy against the model-dtype cache, perplexity); tensor parallel 2 when 2+ GPUs;
#      pre-quantised checkpoints (GPTQ, AWQ, compressed-tensors int4/fp8) on the GPU against
#      CPU, from .gpu-refs/ (write it with `python -m bench.gpu.prequant_refs` before the call
#      and carry it: ~19 MiB; SKIP without it).
#   2. python -m bench.engine_throughput: kvpilot against transformers generate() on this GPU.
#   3. python -m bench.engine_kv_dtype: KV blocks, concurrency and quality auto vs fp8.
#   4. python -m bench.gpu.check --flashinfer: FlashInfer's paged kernels against the SDPA path
#      (one step's attention, bf16 and fp8 KV; greedy tokens) and output tok/s with and without
#      them; SKIP where
#      flashinfer-python does not import. The machines have no FlashInfer and the current wheel
#      (0.7, ~100 MB) does not fit a call's 64 MiB carry; 0.6.0 does (7.5 MB, pure Python, with
#      apache-tvm-ffi's cp312 wheel, 3.3 MB; its other imports are in the device image): fetched
#      into .whl with README's `pip download` line. It compiles its kernels with nvcc on first use
#      (a few minutes, hence the limit). 0.3.1 (built with `pip wheel --no-deps`, no tvm-ffi) is
#      the older fallback.
#   5. python -m bench.gpu.serve_throughput (`--steps serve-throughput`, never by default: a call
#      of its own, ~8 minutes on an H100, estimated): a Llama-3.1-8B-shaped model with random bf16
#      weights written on the GPU (no hub), served over HTTP and loaded by `kvpilot bench` with
#      1000/2000 and 1000/1000 random-token workloads at concurrency 1, 64 and 256: CUDA graphs
#      against --enforce-eager, FlashInfer against SDPA, fp8 KV, int8 weights; vLLM too where it
#      imports. The server needs what the device image lacks, carried as wheels in .whl (README's
#      `pip download` line): fastapi, starlette, uvicorn, pydantic, pydantic-core,
#      annotated-types, typing-inspection, llguidance, redis (bench.server_common imports it).
#      SERVE_VARIANTS=graphs,eager narrows it (bench/gpu/serve_throughput.py names them).
# Results go to the output folder (--out DIR, else $OUT, else /tmp/kvpilot-gpu-check): gpu_check.md /
# .json, gpu_check.log, nvidia-smi.txt, and benchmarks.md (a copy of docs/benchmarks.md with the
# two bench sections rewritten; paste those sections into docs/benchmarks.md). The tree itself is
# not modified.
#
#   bash bench/gpu_check.sh [--device cuda|cpu] [--out DIR] [--steps checks,throughput,kv-dtype,flashinfer,serve-throughput]
#
# --steps runs only the steps named (default: all four), e.g. `--steps flashinfer` where the
# checks have already run on this kind of GPU: a device call may run at most 600 s.
#
# --device cpu is the dry run of every step on CPU (smaller throughput workload), for checking
# the script on a machine without a GPU. Needs a Python with torch and transformers: the project
# venv (.venv from `bash hack/venv.sh`, which needs network once) or PYTHON=/path/to/python.
set -uo pipefail
cd "$(dirname "$0")/.."

device=cuda
out=${OUT:-}
steps=checks,throughput,kv-dtype,flashinfer
usage="usage: bash bench/gpu_check.sh [--device cuda|cpu] [--out DIR] [--steps checks,throughput,kv-dtype,flashinfer,serve-throughput]"
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
for name in ${steps//,/ }; do
  case "$name" in checks|throughput|kv-dtype|flashinfer|serve-throughput) ;; *) echo "unknown step $name; $usage" >&2; exit 2 ;; esac
done
wanted() { [[ ",$steps," == *",$1,"* ]]; }
case "$device" in cuda|cpu) ;; *) echo "--device must be cuda or cpu, got $device" >&2; exit 2 ;; esac
out=${out:-${TMPDIR:-/tmp}/kvpilot-gpu-check}
mkdir -p "$out"
out=$(cd "$out" && pwd)

python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
if ! "$python" -c 'import torch, transformers, safetensors, tokenizers' 2>/dev/null; then
  echo "bench/gpu_check.sh: $python lacks torch/transformers/safetensors/tokenizers." >&2
  echo "  Create the project venv with 'bash hack/venv.sh' (needs network once), or run with" >&2
  echo "  PYTHON=/path/to/python that has them. Nothing is installed here (no network)." >&2
  exit 2
fi
# Appended, not replaced: on a lent machine PYTHONPATH holds the wheels carried there (llguidance).
export PYTHONPATH=$PWD/contract:$PWD/runtime:$PWD/operator:$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ "$device" = cuda ] && ! "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  echo "bench/gpu_check.sh: torch sees no CUDA device here; use --device cpu for the dry run" >&2
  exit 2
fi

exec > >(tee "$out/gpu_check.log") 2>&1
echo "==> $(date -u +%FT%TZ) device $device, python $python, output $out"
"$python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.version.cuda, "GPUs", torch.cuda.device_count())'
if [ "$device" = cuda ]; then nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true; fi

if [ "$device" = cuda ]; then
  throughput_args=(--num-requests 32 --max-output 128)
else
  throughput_args=(--num-requests 8 --max-output 32)
fi
cp docs/benchmarks.md "$out/benchmarks.md"
export KVPILOT_BENCH_DOC=$out/benchmarks.md

failed=()
step() {  # step NAME SECONDS COMMAND...: run with a deadline, remember a failure, carry on
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "==> $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  echo "==> $name: exit $rc after $((SECONDS - start))s"
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

wanted checks && step "checks" 240 "$python" -m bench.gpu.check --device "$device" --out "$out"
wanted throughput && step "throughput vs transformers" 180 "$python" -m bench.engine_throughput "${throughput_args[@]}"
wanted kv-dtype && step "KV dtype" 90 "$python" -m bench.engine_kv_dtype
wanted flashinfer && step "FlashInfer" 420 "$python" -m bench.gpu.check --flashinfer --device "$device" --out "$out"
if wanted serve-throughput; then
  if "$python" -c 'import fastapi, uvicorn, pydantic, llguidance, redis' 2>/dev/null; then
    step "serving throughput" 560 "$python" -m bench.gpu.serve_throughput --device "$device" \
      --out "$out" ${SERVE_VARIANTS:+--variants "$SERVE_VARIANTS"}
  else
    failed+=("serving throughput (the server's packages do not import: carry their wheels, see the header)")
  fi
fi

echo "==> summary ($out)"
[ -f "$out/gpu_check.md" ] && cat "$out/gpu_check.md"
[ -f "$out/gpu_flashinfer.md" ] && cat "$out/gpu_flashinfer.md"
[ -f "$out/serve_throughput.md" ] && cat "$out/serve_throughput.md"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all steps passed"
