#!/usr/bin/env bash
# Creates (once) the project's virtualenv in a cache outside the clone, installed with uv from
# uv.lock and keyed by a hash of the lock (and the Python version), and links it as ./.venv.
# The lock pins every package and its hashes, so a new upstream release cannot change what a
# fresh machine or CI installs. PyTorch is large, so a warm machine must not download it again; a
# new lock makes a new venv (uv's cache keeps that quick), while editing tool config in
# pyproject.toml does not.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
cache_dir=${KVPILOT_CACHE_DIR:-$HOME/.cache/kvpilot}
python=${PYTHON:-python3}

# A lock that disagrees with pyproject.toml would install the wrong set: stop and say so first.
bash hack/lock_check.sh

key=$( (cat uv.lock; "$python" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
venv="$cache_dir/venv/$key"
# uv sync installs into this venv instead of a .venv inside the clone.
export UV_PROJECT_ENVIRONMENT=$venv
mkdir -p "$cache_dir/venv"
exec 9>"$venv.lock"
flock 9  # another clone creating the same venv right now: wait for it, then reuse it

if [ ! -f "$venv/.complete" ]; then
  echo "==> creating virtualenv $venv from uv.lock (first run downloads PyTorch, a few GB; later runs reuse it)"
  rm -rf "$venv"  # a half-made one from an interrupted run; uv sync creates it anew
  # Dependencies only: the project itself is installed editable per clone below, so two clones
  # (the work tree and CI's fresh clone) can share this venv without importing each other's code.
  bash hack/uv.sh sync --locked --extra dev --no-install-project
  touch "$venv/.complete"
fi

# The editable install points at one clone; redo it when another clone used the venv or when
# pyproject.toml (entry points, package dirs) changed since. --inexact: a package someone added by
# hand to the shared venv (trying a library before locking it) is left alone, as pip did.
marker="$root $(sha256sum < pyproject.toml | cut -c1-16)"
if [ "$(cat "$venv/.clone" 2>/dev/null)" != "$marker" ]; then
  echo "==> installing kvpilot (editable) from $root"
  bash hack/uv.sh sync --locked --inexact --extra dev --reinstall-package kvpilot --quiet
  echo "$marker" > "$venv/.clone"
fi
ln -sfn "$venv" .venv
echo "==> virtualenv ready: .venv -> $venv"

# The CPU paged-attention kernel (runtime/kvpilot/runtime/layers/paged_kernel.py) is compiled once
# per machine, source and torch version (cached under ~/.cache/kvpilot/kernels): build it here, so
# no engine start (or test with a start-up timeout) pays the ~15 s. Without a C++ compiler the
# runtime runs decode attention through torch SDPA instead, so this never fails the set-up.
"$venv/bin/python" -m kvpilot.runtime.layers.paged_kernel \
  || echo "==> (no paged-attention kernel here: the runtime falls back to --attention-backend sdpa)"

# Bytecode for every module of the venv, once per venv (.bytecode marks it). uv installs without
# it, and a process that may not write it (PYTHONDONTWRITEBYTECODE, as CI and the images set;
# a venv it cannot write) compiles torch's ~2,400 modules from source at every start: half of a
# runtime's start-up (docs/benchmarks.md, cold start). A module that does not compile (a
# package's Python 2 example) only keeps its source; the set-up goes on.
if [ ! -f "$venv/.bytecode" ]; then
  echo "==> compiling the virtualenv's bytecode (once, about a minute)"
  "$venv/bin/python" -m compileall -q -j 0 "$venv/lib" > /dev/null \
    || echo "==> (some modules did not compile; they run from source)"
  touch "$venv/.bytecode"
fi

# And this clone's own packages, which the editable install runs from source: a process that may
# not write bytecode (the dev cluster's runtime pods inherit PYTHONDONTWRITEBYTECODE) would compile
# them at every start, ~0.2 s of CPU on the way to Ready (docs/benchmarks.md, cold start). Every
# run, as it is quick: compileall rewrites only what changed, and Python ignores a .pyc whose
# source changed since, so an edit never runs stale.
"$venv/bin/python" -m compileall -q -j 0 contract operator runtime gateway > /dev/null \
  || echo "==> (some of kvpilot's modules did not compile; they run from source)"
