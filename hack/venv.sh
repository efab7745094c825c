#!/usr/bin/env bash
# Creates (once) the project's virtualenv in a cache outside the clone, keyed by a hash of the
# dependencies declared in pyproject.toml (and the Python version), and links it as ./.venv.
# PyTorch is large, so a warm machine must not download it again; a changed dependency makes a
# new venv (pip's cache keeps that quick), while editing tool config in pyproject.toml does not.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
cache_dir=${KVPILOT_CACHE_DIR:-$HOME/.cache/kvpilot}
python=${PYTHON:-python3}
key=$( ("$python" hack/list_deps.py pyproject.toml dev; "$python" -c 'import sys; print(sys.version)') \
  | sha256sum | cut -c1-16)
venv="$cache_dir/venv/$key"

if [ ! -f "$venv/.complete" ]; then
  echo "==> creating virtualenv $venv (first run downloads PyTorch, a few GB; later runs reuse it)"
  rm -rf "$venv"
  mkdir -p "$cache_dir/venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --progress-bar off --upgrade pip hatchling >/dev/null
  # Dependencies only: the project itself is installed editable per clone below, so two clones
  # (the work tree and CI's fresh clone) can share this venv without importing each other's code.
  "$venv/bin/python" hack/list_deps.py pyproject.toml dev > "$venv/requirements.txt"
  "$venv/bin/pip" install --progress-bar off -r "$venv/requirements.txt" \
    | grep -E '^(Collecting|Successfully)' | sed 's/^/    /' || true
  "$venv/bin/pip" check >/dev/null || { echo "pip check failed in $venv" >&2; exit 1; }
  touch "$venv/.complete"
fi

# The editable install is a .pth pointing at this clone; redo it when another clone used the venv.
if [ "$(cat "$venv/.clone" 2>/dev/null)" != "$root" ]; then
  echo "==> installing kvpilot (editable) from $root"
  "$venv/bin/pip" install --no-deps --no-build-isolation -q -e "$root"
  echo "$root" > "$venv/.clone"
fi
ln -sfn "$venv" .venv
echo "==> virtualenv ready: .venv -> $venv"
