#!/usr/bin/env bash
# Fails, saying what to do, when uv.lock no longer matches the dependencies in pyproject.toml
# (someone edited pyproject.toml without running `make lock`). Offline and about 0.1 s: a current
# lock is checked against pyproject.toml without any download, so this cannot flake on the network
# and runs in every `make` target's set-up (hack/venv.sh) as well as in `make lock-check`.
# Usage: bash hack/lock_check.sh [PROJECT_DIR]   (default: this clone)
set -euo pipefail
uv_sh="$(cd "$(dirname "$0")" && pwd)/uv.sh"
project=${1:-$(dirname "$0")/..}
bash "$uv_sh" --version >/dev/null  # installs uv on first use, its progress visible
out=$(bash "$uv_sh" lock --check --offline --directory "$project" 2>&1) && exit 0
# Offline, uv reports a stale lock as "needs to be updated" or, when the new requirements are not
# in its cache, as a failed resolution with the network disabled; anything else (a malformed
# pyproject.toml, say) is shown in uv's own words.
if grep -qE 'needs to be updated|network was disabled' <<<"$out"; then
  cat >&2 <<MSG
error: uv.lock does not match the dependencies in pyproject.toml (edited without \`make lock\`?).
  Run \`make lock\` (needs PyPI) and commit uv.lock together with pyproject.toml.
MSG
else
  { echo "error: uv could not check uv.lock against pyproject.toml:"; sed 's/^/    /' <<<"$out"; } >&2
fi
exit 1
