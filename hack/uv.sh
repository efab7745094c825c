#!/usr/bin/env bash
# Runs the project's uv: `bash hack/uv.sh ARGS...` (e.g. `bash hack/uv.sh lock`).
# The version and its wheels' hashes are pinned in hack/uv-requirements.txt; the first run installs
# it with pip into a small tool venv in the cache (keyed by that file), since a fresh machine or CI
# has only python3 and PyPI. uv's own cache lives under the same cache dir, so
# KVPILOT_CACHE_DIR=/some/empty/dir gives a truly cold run. uv never downloads a Python: it uses
# $PYTHON (default python3), the interpreter CI runs.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache_dir=${KVPILOT_CACHE_DIR:-$HOME/.cache/kvpilot}
# The interpreter itself, not a launcher such as a pyenv shim: uv compares a venv's Python with
# this path and would otherwise rebuild the venv on every sync.
python=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)') \
  || { echo "hack/uv.sh: ${PYTHON:-python3} is not a working Python; set PYTHON" >&2; exit 1; }
pins="$here/uv-requirements.txt"
tool="$cache_dir/tools/uv-$(sha256sum < "$pins" | cut -c1-16)"

mkdir -p "$cache_dir/tools"
(
  flock 9  # two clones setting up at once must not install into the same dir together
  if [ ! -f "$tool/.complete" ]; then
    echo "==> installing $(grep -o '^uv==[^ ]*' "$pins") into $tool" >&2
    rm -rf "$tool"
    "$python" -m venv "$tool"
    "$tool/bin/pip" install --quiet --disable-pip-version-check --no-deps --require-hashes \
      -r "$pins" >&2
    touch "$tool/.complete"
  fi
) 9>"$tool.lock"

export UV_CACHE_DIR=${UV_CACHE_DIR:-$cache_dir/uv}
export UV_PYTHON=$python UV_PYTHON_DOWNLOADS=never
exec "$tool/bin/uv" "$@"
