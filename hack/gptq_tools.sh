#!/usr/bin/env bash
# Creates (once) the tool venv that runs GPTQModel, which writes the GPTQ/AWQ reference checkpoints
# of tests/runtime/test_rt_gptq_awq.py (bench/reference/gptq_awq.py), and prints its python's path
# on stdout (progress goes to stderr). GPTQModel is not a dependency of the project: its venv lives
# in the cache, keyed by GPTQModel's version, a hash of hack/gptq-requirements.txt (every package
# it adds, pinned with hashes) and the project venv it builds on.
# torch and the rest come from the project's venv (a .pth adds its site-packages after the tool
# venv's own), so PyTorch is neither downloaded nor installed twice; a new uv.lock makes a new
# project venv and so a new tool venv. Installed with the project's uv from PyPI, --no-deps.
# GPTQModel 7.x's sdist compiles no extension at install (its CPU/CUDA kernels are built on first
# use, and the torch backend the references use needs none), so no nvcc or CUDA knob is involved.
set -euo pipefail
cd "$(dirname "$0")/.."
cache_dir=${KVPILOT_CACHE_DIR:-$HOME/.cache/kvpilot}
pins=hack/gptq-requirements.txt
project=$(readlink -f .venv)
[ -x "$project/bin/python" ] || { echo "hack/gptq_tools.sh: no project venv at .venv; run make setup" >&2; exit 1; }

version=$(grep -o '^gptqmodel==[^ ]*' "$pins" | cut -d= -f3)
key=$( (cat "$pins"; echo "$project") | sha256sum | cut -c1-16)
tool="$cache_dir/tools/gptqmodel-$version-$key"
mkdir -p "$cache_dir/tools"
exec 9>"$tool.lock"
flock 9  # another clone or test run making the same venv right now: wait, then reuse it

if [ ! -f "$tool/.complete" ]; then
  started=$(date +%s)
  echo "==> creating the GPTQModel $version tool venv $tool (once per version)" >&2
  rm -rf "$tool"  # a half-made one from an interrupted run
  bash hack/uv.sh venv --quiet --python "$project/bin/python" "$tool" >&2
  site=$("$tool/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  project_site=$("$project/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir, not a bare path: the project venv's own .pth files (kvpilot's editable install)
  # are read too.
  echo "import site; site.addsitedir('$project_site')" > "$site/_kvpilot_project_venv.pth"
  echo "==> installing $(grep -c '^[a-z]' "$pins") pinned packages (GPTQModel and what the project venv lacks)" >&2
  bash hack/uv.sh pip install --python "$tool/bin/python" --no-deps --require-hashes \
    --index-url https://pypi.org/simple -r "$pins" >&2
  "$tool/bin/python" -c 'import gptqmodel' >&2
  touch "$tool/.complete"
  echo "==> GPTQModel tool venv ready in $(( $(date +%s) - started ))s" >&2
fi
echo "$tool/bin/python"
