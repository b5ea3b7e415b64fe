#!/usr/bin/env bash
# Make .venv and install into it the pinned dependencies (requirements.lock) and the
# project itself (editable), for scripts/serve-demo and scripts/test.
#
#   scripts/install-venv.sh [REQUIREMENT ...]   # each extra one installed without its
#                                               # own dependencies (--no-deps)
#
# The installer is uv (pinned below, itself installed into the venv by pip): it fetches
# and unpacks the ~130 wheels in parallel and compiles them on every core, ~15 s on a
# 2-core machine where pip takes ~65 s on one. Where uv cannot be had or fails (a host
# whose only index is pip's own configuration, which uv does not read), pip does it.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[install-venv] %s\n' "$*" >&2; }
UV_VERSION=0.13.9

python3 -m venv .venv
# pip's "Location ... is ignored" warnings (a find-links folder this host lacks) are noise.
quiet_pip() { .venv/bin/pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v '^WARNING: Location' || true; }

with_uv() {
  local uv=(.venv/bin/uv pip install -q --python .venv/bin/python)
  "${uv[@]}" --compile-bytecode -r requirements.lock \
    && "${uv[@]}" --no-deps -e . \
    && { [ $# = 0 ] || "${uv[@]}" --no-deps "$@"; }
}
with_pip() {
  quiet_pip -r requirements.lock
  quiet_pip --no-deps -e .
  if [ $# -gt 0 ]; then quiet_pip --no-deps "$@"; fi
}

if .venv/bin/pip install -q --disable-pip-version-check "uv==$UV_VERSION" >/dev/null 2>&1 \
   && with_uv "$@"; then
  :
else
  say "uv $UV_VERSION could not install the lock: pip installs it instead (about a minute)"
  with_pip "$@"
fi
.venv/bin/python -c "import openalice_scheduler" \
  || { say "the project does not import from .venv"; exit 1; }
touch .venv/.installed
