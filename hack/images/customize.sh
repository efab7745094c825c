#!/usr/bin/env bash
# mmdebstrap --customize-hook (root mode, run on the host): installs the locked virtualenv into the
# root filesystem "$1" and adds the image's user. uv runs inside the root filesystem (chroot), so
# the venv's interpreter, scripts and pyvenv.cfg name the image's own paths, not the host's.
# Inputs from hack/images/build.py: KVPILOT_IMAGE_STAGE (uv, requirements.txt, the kvpilot wheel,
# kernels/ when the image ships the prebuilt paged-attention kernel), KVPILOT_COMPILE_BYTECODE,
# KVPILOT_SYSTEM_SITE_PACKAGES (the venv sees Debian's dist-packages: the CPU image's torch),
# KVPILOT_WHEEL, KVPILOT_PASSWD_LINE, KVPILOT_GROUP_LINE, KVPILOT_OWNED_DIRS, KVPILOT_UID, VENV,
# UV_CACHE_DIR (the host's uv cache: warm machines download nothing) and SOURCE_DATE_EPOCH.
set -euo pipefail
root=$1
build=/tmp/kvpilot-build  # inside the root filesystem; removed before mmdebstrap packs it
mkdir -p "$root$build/uv-cache"
cp "$KVPILOT_IMAGE_STAGE/uv" "$KVPILOT_IMAGE_STAGE/requirements.txt" \
  "$KVPILOT_IMAGE_STAGE/$KVPILOT_WHEEL" "$root$build/"
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
in_root "$build/uv" venv --quiet --python /usr/bin/python3 \
  ${KVPILOT_SYSTEM_SITE_PACKAGES:+--system-site-packages} "$VENV"
in_root "$build/uv" pip sync --quiet --python "$VENV/bin/python" --require-hashes \
  ${KVPILOT_COMPILE_BYTECODE:+--compile-bytecode} "$build/requirements.txt"
# From a flat index (no direct_url.json naming a file the image lacks). --refresh-package: a
# wheel of the same version from an earlier build must not come from uv's cache.
version=${KVPILOT_WHEEL#kvpilot-}
in_root "$build/uv" pip install --quiet --python "$VENV/bin/python" --no-deps --no-index \
  --refresh-package kvpilot --find-links "$build" "kvpilot==${version%%-*}"
# uv notes a local wheel's ctime in dist-info/uv_cache.json (its own reinstall check, which an
# image never runs): that timestamp would make every build's digest differ, so it goes, and its
# RECORD line with it.
for dist_info in "$root$VENV"/lib/python3*/site-packages/kvpilot-*.dist-info; do
  rm -f "$dist_info/uv_cache.json"
  sed -i '/\.dist-info\/uv_cache\.json,/d' "$dist_info/RECORD"
done

# The paged-attention kernels built for portable levels (paged_kernel.prebuilt_root)
if [ -d "$KVPILOT_IMAGE_STAGE/kernels" ]; then
  mkdir -p "$root$VENV/share/kvpilot"
  cp -r "$KVPILOT_IMAGE_STAGE/kernels" "$root$VENV/share/kvpilot/kernels"
fi

umount "$root$build/uv-cache"
trap - EXIT
rm -rf "$root$build" "$root/root/.cache"

echo "$KVPILOT_PASSWD_LINE" >> "$root/etc/passwd"
echo "$KVPILOT_GROUP_LINE" >> "$root/etc/group"
for dir in $KVPILOT_OWNED_DIRS; do
  mkdir -p "$root$dir"
  chown "$KVPILOT_UID:$KVPILOT_UID" "$root$dir"
done
