#!/usr/bin/env bash
# Make `promtool` (Prometheus's rule checker) available, for the tests of
# deploy/alerts.yml. Idempotent: an installed promtool is left as it is; otherwise, as
# root on Debian, Debian's prometheus package is installed (it provides promtool; no
# Prometheus server is started in a container without an init system).
set -euo pipefail
say() { printf '[ensure-promtool] %s\n' "$*" >&2; }

if command -v promtool >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  say "promtool not found and this is not root: install Debian's prometheus package"
  exit 1
fi
say "installing Debian's prometheus package (for promtool)"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v promtool >/dev/null 2>&1 || { say "promtool still not found"; exit 1; }
