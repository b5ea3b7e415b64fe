#!/usr/bin/env bash
# Build the demo worker image locally, without a registry: Debian's static busybox,
# imported as an image whose default command serves HTTP on $PORT (default 8080) and
# answers with the lease it belongs to. Its health path ($READY_PATH, default /healthz)
# answers 200 only $READY_DELAY_SECONDS (default 0) after start, or never with
# READY_DELAY_SECONDS=never: a worker that is slow, or never, ready (README, Workers
# ready when handed out). It answers the warm-pool hand-off at /cgi-bin/lease (busybox
# httpd runs CGI only there: set WARM_HANDOFF_PATH=/cgi-bin/lease for this image) and
# then shows the lease handed off, env included, under "handoff" at GET / (README, Warm
# pools); while /tmp/handoff-hold exists, a hand-off waits (the tests hold one between
# the scheduler's claim and its answer). Idempotent: an existing image is kept unless it was built
# from another entry script (label openalice.worker.entry, the script's hash) or
# --rebuild is given.
#   scripts/build-worker-image.sh [IMAGE] [--rebuild]
set -euo pipefail
image="${1:-openalice-demo-worker:latest}"
say() { printf '[build-worker-image] %s\n' "$*" >&2; }

entry=$(cat <<'SH'
#!/bin/sh
# Demo worker: tell who we are, then serve HTTP until stopped; the health path answers
# once READY_DELAY_SECONDS have passed (never, with "never").
/bin/busybox mkdir -p /www
printf '{"worker":"openalice-demo","kind":"%s","lease_id":"%s","expires_at":"%s"}\n' \
  "$WORKER_KIND" "$LEASE_ID" "$LEASE_EXPIRES_AT" > /www/index.html
# The warm-pool hand-off: the POSTed lease (its env kept from the first one, a renewal's
# hand-on has none) and the latest expiry, shown at GET /.
printf 'WORKER_KIND=%s\nLEASE_ID=%s\n' "$WORKER_KIND" "$LEASE_ID" > /tmp/worker.env
/bin/busybox mkdir -p /www/cgi-bin
/bin/busybox cat > /www/cgi-bin/lease <<'CGI'
#!/bin/sh
# Shell builtins only (no process started): the hand-off is on the acquire's path.
. /tmp/worker.env
while [ -e /tmp/handoff-hold ]; do /bin/busybox sleep 0.1; done
IFS= read -r -n "${CONTENT_LENGTH:-0}" body
case "$body" in *'"env"'*) printf '%s' "$body" > /tmp/handoff.json ;; esac
rest=${body#*'"expires_at":"'}
IFS= read -r handoff < /tmp/handoff.json
printf '{"worker":"openalice-demo","kind":"%s","lease_id":"%s","expires_at":"%s","handoff":%s}\n' \
  "$WORKER_KIND" "$LEASE_ID" "${rest%%'"'*}" "$handoff" > /www/index.html
printf 'Content-Type: application/json\r\n\r\n{"ok":true}\n'
CGI
/bin/busybox chmod +x /www/cgi-bin/lease
health="/www${READY_PATH:-/healthz}"
delay="${READY_DELAY_SECONDS:-0}"
if [ "$delay" = 0 ]; then
  echo ok > "$health"
elif [ "$delay" != never ]; then
  ( /bin/busybox sleep "$delay" && echo ok > "$health" ) &
fi
exec /bin/busybox httpd -f -p "${PORT:-8080}" -h /www
SH
)
hash=$(printf '%s' "$entry" | sha256sum | cut -c1-16)

if [ "${2:-}" != --rebuild ]; then
  have=$(docker image inspect -f '{{ index .Config.Labels "openalice.worker.entry" }}' \
    "$image" 2>/dev/null || true)
  if [ "$have" = "$hash" ]; then
    say "$image already present"
    exit 0
  fi
  if docker image inspect "$image" >/dev/null 2>&1; then
    say "$image was built from another entry script: rebuilding"
  fi
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/rootfs/bin" "$work/rootfs/www" "$work/rootfs/tmp"
if [ -x /bin/busybox ] && /bin/busybox --help 2>&1 | head -1 | grep -q . \
   && ! ldd /bin/busybox >/dev/null 2>&1; then
  cp /bin/busybox "$work/rootfs/bin/busybox"          # already static
else
  ( cd "$work" && { apt-get download busybox-static >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get download busybox-static >/dev/null; }; } \
    && dpkg -x busybox-static_*.deb pkg && cp pkg/bin/busybox rootfs/bin/busybox )
fi
ln -s busybox "$work/rootfs/bin/sh"
printf '%s\n' "$entry" > "$work/rootfs/entry.sh"
chmod +x "$work/rootfs/entry.sh"
tar -C "$work/rootfs" -c . | docker import \
  --change 'CMD ["/bin/sh", "/entry.sh"]' --change 'EXPOSE 8080' \
  --change "LABEL openalice.worker.entry=$hash" - "$image" >/dev/null
say "built $image"
