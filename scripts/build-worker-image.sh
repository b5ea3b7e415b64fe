#!/usr/bin/env bash
# Build the demo worker image locally, without a registry: Debian's static busybox,
# imported as an image whose default command serves HTTP on $PORT (default 8080) and
# answers with the lease it belongs to. Idempotent: an existing image is kept unless
# --rebuild is given.
#   scripts/build-worker-image.sh [IMAGE] [--rebuild]
set -euo pipefail
image="${1:-openalice-demo-worker:latest}"
say() { printf '[build-worker-image] %s\n' "$*" >&2; }

if [ "${2:-}" != --rebuild ] && docker image inspect "$image" >/dev/null 2>&1; then
  say "$image already present"
  exit 0
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
cat > "$work/rootfs/entry.sh" <<'SH'
#!/bin/sh
# Demo worker: tell who we are, then serve HTTP until stopped.
/bin/busybox mkdir -p /www
printf '{"worker":"openalice-demo","kind":"%s","lease_id":"%s","expires_at":"%s"}\n' \
  "$WORKER_KIND" "$LEASE_ID" "$LEASE_EXPIRES_AT" > /www/index.html
exec /bin/busybox httpd -f -p "${PORT:-8080}" -h /www
SH
chmod +x "$work/rootfs/entry.sh"
tar -C "$work/rootfs" -c . | docker import \
  --change 'CMD ["/bin/sh", "/entry.sh"]' --change 'EXPOSE 8080' - "$image" >/dev/null
say "built $image"
