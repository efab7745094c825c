#!/usr/bin/env bash
# Debian packages the tests use: openssl (dev-cluster certificates), prometheus (a real Prometheus
# for the metrics-adapter tests, and promtool; the dev cluster builds its own Prometheus because
# Debian's lacks Kubernetes service discovery), Go (builds the cluster binaries) and redis-server
# (the gateway's shared budget and cache store; tests start their own on free ports), mmdebstrap
# and umoci (`make images`: a Debian root filesystem, packed as an OCI image without a daemon).
# Installs what is missing when run as root.
set -euo pipefail
missing=()
command -v openssl >/dev/null || missing+=(openssl)
command -v prometheus >/dev/null || missing+=(prometheus)
command -v go >/dev/null || missing+=(golang-go)
command -v redis-server >/dev/null || missing+=(redis-server)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
command -v umoci >/dev/null || missing+=(umoci)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "missing Debian packages: ${missing[*]} — install them with: sudo apt-get install ${missing[*]}" >&2
  exit 1
fi
echo "==> installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# The Debian package starts a system Prometheus on :9090; tests start their own on free ports.
if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
  systemctl stop prometheus || true
fi
if command -v systemctl >/dev/null && systemctl is-active --quiet redis-server 2>/dev/null; then
  systemctl stop redis-server || true
fi
