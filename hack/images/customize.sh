#!/usr/bin/env bash
# The steps of hack/images/build.py that run in an image's root filesystem ROOT (root, on the host):
#   customize.sh user ROOT  the image's user and its directories (mmdebstrap's customize hook of the
#                           base layer)
#   customize.sh venv ROOT  the locked virtualenv (the venv layer; ROOT is an overlay on the base)
#   customize.sh app ROOT   the kvpilot wheel into that venv (the app layer; an overlay on both)
# uv runs inside ROOT (chroot), so the venv's interpreter, scripts and pyvenv.cfg name the image's
# own paths, not the host's. Inputs from build.py: KVPILOT_IMAGE_STAGE (uv, requirements.txt, the
# kvpilot wheel), KVPILOT_COMPILE_BYTECODE, KVPILOT_SYSTEM_SITE_PACKAGES (the venv sees Debian's
# dist-packages: the CPU image's torch), KVPILOT_WHEEL, KVPILOT_PASSWD_LINE, KVPILOT_GROUP_LINE,
# KVPILOT_OWNED_DIRS, KVPILOT_UID, VENV, UV_CACHE_DIR (the host's uv cache: warm machines
# download nothing) and SOURCE_DATE_EPOCH.
set -euo pipefail
step=$1
root=$2

if [ "$step" = user ]; then
  echo "$KVPILOT_PASSWD_LINE" >> "$root/etc/passwd"
  echo "$KVPILOT_GROUP_LINE" >> "$root/etc/group"
  for dir in $KVPILOT_OWNED_DIRS; do
    mkdir -p "$root$dir"
    chown "$KVPILOT_UID:$KVPILOT_UID" "$root$dir"
  done
  exit 0
fi

build=/tmp/kvpilot-build  # inside the root filesystem; removed before the layer is packed
mkdir -p "$root$build/uv-cache"
cp "$KVPILOT_IMAGE_STAGE/uv" "$root$build/"
# The host's CA bundle (SSL_CERT_FILE, e.g. a proxy's CA) for uv's downloads; gone with $build.
cp "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}" "$root$build/ca.crt"
mount --bind "$UV_CACHE_DIR" "$root$build/uv-cache"
trap 'umount "$root$build/uv-cache" 2>/dev/null || true' EXIT

in_root() {
  # copy, never hardlink: a hardlink would tie the image's files to the host cache's inodes
  chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    UV_CACHE_DIR=$build/uv-cache UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1 \
    SSL_CERT_FILE=$build/ca.crt SOURCE_DATE_EPOCH="$SOURCE_DATE_EPOCH" "$@"
}

compile_bytecode() {
  # DIR (a path inside ROOT) byte-compiled by compile_pyc.py, not uv's --compile-bytecode:
  # uv's .pyc bytes depend on which files shared a worker (compile_pyc.py says why).
  cp "$(dirname "$0")/compile_pyc.py" "$root$build/"
  in_root env PYTHONHASHSEED=0 "$VENV/bin/python" "$build/compile_pyc.py" "$1"
}

case $step in
  venv)
    cp "$KVPILOT_IMAGE_STAGE/requirements.txt" "$root$build/"
    in_root "$build/uv" venv --quiet --python /usr/bin/python3 \
      ${KVPILOT_SYSTEM_SITE_PACKAGES:+--system-site-packages} "$VENV"
    in_root "$build/uv" pip sync --quiet --python "$VENV/bin/python" --require-hashes \
      "$build/requirements.txt"
    if [ -n "$KVPILOT_COMPILE_BYTECODE" ]; then
      compile_bytecode "$VENV/lib"
    fi
    ;;
  app)
    cp "$KVPILOT_IMAGE_STAGE/$KVPILOT_WHEEL" "$root$build/"
    # From a flat index (no direct_url.json naming a file the image lacks). --refresh-package: a
    # wheel of the same version from an earlier build must not come from uv's cache.
    version=${KVPILOT_WHEEL#kvpilot-}
    in_root "$build/uv" pip install --quiet --python "$VENV/bin/python" --no-deps --no-index \
      --refresh-package kvpilot --find-links "$build" "kvpilot==${version%%-*}"
    # uv notes a local wheel's ctime in dist-info/uv_cache.json (its own reinstall check, which an
    # image never runs): that timestamp would make every build's digest differ, so it goes, and
    # its RECORD line with it.
    for dist_info in "$root$VENV"/lib/python3*/site-packages/kvpilot-*.dist-info; do
      rm -f "$dist_info/uv_cache.json"
      sed -i '/\.dist-info\/uv_cache\.json,/d' "$dist_info/RECORD"
    done
    # kvpilot's own bytecode too (a pod cannot write it: PYTHONDONTWRITEBYTECODE, read-only
    # layers), so no start compiles its modules; only kvpilot's directory, or the venv layer's
    # files would be copied up into this one.
    if [ -n "$KVPILOT_COMPILE_BYTECODE" ]; then
      for package in "$root$VENV"/lib/python3*/site-packages/kvpilot; do
        compile_bytecode "${package#"$root"}"
      done
    fi
    ;;
  *)
    echo "customize.sh: no step $step (user, venv, app)" >&2
    exit 2
    ;;
esac

umount "$root$build/uv-cache"
trap - EXIT
rm -rf "$root$build" "$root/root/.cache"
