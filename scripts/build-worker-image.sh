#!/usr/bin/env bash
# Build the demo worker image locally, without a registry: Debian's static busybox,
# imported as an image whose default command serves HTTP on $PORT (default 8080) and
# answers with the lease it belongs to. Its health path ($READY_PATH, default /healthz)
# answers 200 only $READY_DELAY_SECONDS (default 0) after start, or never with
# READY_DELAY_SECONDS=never: a worker that is slow, or never, ready
# (docs/concepts/readiness-and-loss.md#workers-ready-when-handed-out). It answers the warm-pool
# hand-off at /openalice/lease, the scheduler's default WARM_HANDOFF_PATH (and at /cgi-bin/lease),
# then shows the lease handed off, env included, under "handoff" at GET /
# (docs/concepts/pools.md#warm-pools); while /tmp/handoff-hold exists, a hand-off waits (the tests
# hold one between the scheduler's claim and its answer). busybox httpd runs CGI only under
# /cgi-bin/ and this busybox has no reverse proxy, so busybox nc accepts the connections and a front
# script hands each request to `httpd -i`, with any /openalice/<name> rewritten to the CGI script
# /cgi-bin/<name>: a new /openalice/ call (POST /openalice/preempt, say) is one more script in
# /www/cgi-bin. With LEASE_SELF_URL it asks after its lease every SELF_CHECK_SECONDS (default 2) and
# stops itself once the lease has ended, or once the scheduler is silent past the lease's expiry;
# /cgi-bin/work answers 409 to a request whose X-Lease-Fence is older than the lease it serves
# (docs/concepts/worker-self.md#what-a-worker-knows-of-its-lease). A preemption notice (POST
# /openalice/preempt) is kept at GET /preempt.json. SIGTERM ends it at any moment, after
# STOP_DELAY_SECONDS (default 0): a worker slow to stop. Idempotent: an existing image is kept unless it
# was built from another entry script (label openalice.worker.entry, the script's hash) or --rebuild
# is given.
#   scripts/build-worker-image.sh [IMAGE] [--rebuild]
set -euo pipefail
image="${1:-openalice-demo-worker:latest}"
say() { printf '[build-worker-image] %s\n' "$*" >&2; }

entry=$(cat <<'SH'
#!/bin/sh
# Demo worker: tell who we are, then serve HTTP until stopped; the health path answers
# once READY_DELAY_SECONDS have passed (never, with "never").
# Stopped (SIGTERM, SIGINT) at any moment, it ends. The trap is set first: the shell is its
# container's first process, which ignores a signal it has no trap for. With
# STOP_DELAY_SECONDS it takes that long to end, as a worker with work to finish does (its
# engine kills it once its grace period is over).
server=
ending() {
  [ "${STOP_DELAY_SECONDS:-0}" = 0 ] || /bin/busybox sleep "$STOP_DELAY_SECONDS"
  [ -z "$server" ] || /bin/busybox kill "$server"
  exit 0
}
trap ending TERM INT
/bin/busybox mkdir -p /www
# GET / is written whole, then renamed into place: a reader never sees it half written.
printf '{"worker":"openalice-demo","kind":"%s","lease_id":"%s","expires_at":"%s","fence":%s}\n' \
  "$WORKER_KIND" "$LEASE_ID" "$LEASE_EXPIRES_AT" "${LEASE_FENCE:-null}" > /www/.index.new
/bin/busybox mv /www/.index.new /www/index.html
# What the worker knows of the lease it serves now, one value a line: fence, expiry,
# LEASE_SELF_URL, LEASE_TOKEN. From its environment, then from each hand-off.
printf '%s\n' "$LEASE_FENCE" "$LEASE_EXPIRES_AT" "$LEASE_SELF_URL" "$LEASE_TOKEN" \
  > /tmp/lease.state
# The warm-pool hand-off: the POSTed lease (its env kept from the first one, a renewal's
# hand-on has none) and the latest expiry, shown at GET /.
printf 'WORKER_KIND=%s\nLEASE_ID=%s\n' "$WORKER_KIND" "$LEASE_ID" > /tmp/worker.env
/bin/busybox mkdir -p /www/cgi-bin
/bin/busybox cat > /www/cgi-bin/lease <<'CGI'
#!/bin/sh
# Shell builtins but one mv (GET / replaced whole): the hand-off is on the acquire's path.
. /tmp/worker.env
while [ -e /tmp/handoff-hold ]; do /bin/busybox sleep 0.1; done
IFS= read -r -n "${CONTENT_LENGTH:-0}" body
case "$body" in *'"env"'*) printf '%s' "$body" > /tmp/handoff.json ;; esac
# The scheduler's keys come before the caller's env: the first match is theirs.
field() { rest=${body#*\"$1\":}; rest=${rest#\"}; value=${rest%%[\",\}]*}; }
field expires_at; expires=$value
field fence; fence=$value
field self_url; url=$value
field token; token=$value
case "$body" in *'"token"'*) ;; *) url= token= ;; esac
printf '%s\n' "$fence" "$expires" "$url" "$token" > /tmp/lease.state
IFS= read -r handoff < /tmp/handoff.json
printf '{"worker":"openalice-demo","kind":"%s","lease_id":"%s","expires_at":"%s","fence":%s,"handoff":%s}\n' \
  "$WORKER_KIND" "$LEASE_ID" "$expires" "$fence" "$handoff" > /www/.index.new
/bin/busybox mv /www/.index.new /www/index.html  # whole, as at the start
printf 'Content-Type: application/json\r\n\r\n{"ok":true}\n'
CGI
# Fencing: a request whose X-Lease-Fence is older than the lease served now is refused.
/bin/busybox cat > /www/cgi-bin/work <<'CGI'
#!/bin/sh
read -r fence < /tmp/lease.state
given=${HTTP_X_LEASE_FENCE:-}
case "$given" in
  ''|*[!0-9]*) printf 'Status: 400 Bad Request\r\nContent-Type: application/json\r\n\r\n'
               printf '{"error":"X-Lease-Fence missing or not a number"}\n'; exit 0 ;;
esac
if [ "$given" -lt "${fence:-0}" ]; then
  printf 'Status: 409 Conflict\r\nContent-Type: application/json\r\n\r\n'
  printf '{"error":"stale_fence","fence":%s,"given":%s}\n' "$fence" "$given"
else
  printf 'Content-Type: application/json\r\n\r\n{"ok":true,"fence":%s}\n' "${fence:-null}"
fi
CGI
# The preemption notice (docs/concepts/priorities.md#priorities-and-preemption): the POSTed body
# kept at GET /preempt.json; the demo worker has no work to save, so it only remembers it.
/bin/busybox cat > /www/cgi-bin/preempt <<'CGI'
#!/bin/sh
IFS= read -r -n "${CONTENT_LENGTH:-0}" body
printf '%s\n' "$body" > /www/.preempt.new
/bin/busybox mv /www/.preempt.new /www/preempt.json
printf 'Content-Type: application/json\r\n\r\n{"ok":true}\n'
CGI
/bin/busybox chmod +x /www/cgi-bin/lease /www/cgi-bin/work /www/cgi-bin/preempt
# The front: one connection on stdin/stdout (busybox nc -ll -e). busybox httpd runs CGI
# only under /cgi-bin/, so /openalice/<name> (a name of letters, digits, - and _) is
# rewritten to /cgi-bin/<name>, query kept; then the request, headers and body go on
# unchanged to httpd in inetd mode, which answers on the same connection. Shell builtins
# but for the body's copy and httpd: every request (probes too) passes here.
/bin/busybox cat > /front <<'FRONT'
#!/bin/sh
cr=$'\r'
IFS= read -r -t 60 request || exit 0
request=${request%"$cr"}
method=${request%% *}; rest=${request#* }; target=${rest%% *}; version=${rest#"$target"}
path=${target%%\?*}; name=${path#/openalice/}
case "$name" in
  "$path"|''|*[!A-Za-z0-9_-]*) ;;
  *) target="/cgi-bin/$name${target#"$path"}" ;;
esac
head="$method $target$version$cr
" length=0
while IFS= read -r -t 60 line && [ -n "${line%"$cr"}" ]; do
  head="$head$line
"
  case "$line" in [Cc][Oo][Nn][Tt][Ee][Nn][Tt]-[Ll][Ee][Nn][Gg][Tt][Hh]:*)
    length=${line#*:}; length=${length%"$cr"}; length=${length# } ;;
  esac
done
{ printf '%s%s\n' "$head" "$cr"
  [ "$length" -gt 0 ] 2>/dev/null && /bin/busybox head -c "$length"; } \
  | /bin/busybox httpd -i -h /www
# The signal a CGI script left for the worker's main process (exit, hog: either ends the
# worker) is sent only now, its answer written: sent from the script, the worker could end
# before httpd passed the answer on, and its caller would see the connection closed.
if [ -e /tmp/after-answer ]; then
  signal=$(/bin/busybox cat /tmp/after-answer)
  /bin/busybox rm -f /tmp/after-answer
  /bin/busybox kill -"$signal" 1
fi
FRONT
/bin/busybox chmod +x /front
health="/www${READY_PATH:-/healthz}"
delay="${READY_DELAY_SECONDS:-0}"
if [ "$delay" = 0 ]; then
  echo ok > "$health"
elif [ "$delay" != never ]; then
  ( /bin/busybox sleep "$delay" && echo ok > "$health" ) &
fi
# Ending on request, as a worker that crashes does
# (docs/concepts/readiness-and-loss.md#a-worker-lost-after-its-hand-out): /cgi-bin/exit?N makes the
# worker exit with code N; /cgi-bin/hog makes its main process take HOG_MEGABYTES (default 256) of
# memory, which the kernel's OOM killer ends when the container has a smaller memory limit (`docker
# update --memory`).
/bin/busybox cat > /www/cgi-bin/exit <<'CGI'
#!/bin/sh
code=${QUERY_STRING:-1}
case "$code" in ''|*[!0-9]*) code=1 ;; esac
printf '%s\n' "$code" > /tmp/exit-code
printf 'Content-Type: application/json\r\n\r\n{"exiting":%s}\n' "$code"
echo USR2 > /tmp/after-answer
CGI
/bin/busybox cat > /www/cgi-bin/hog <<'CGI'
#!/bin/sh
printf 'Content-Type: application/json\r\n\r\n{"hogging":true}\n'
echo USR1 > /tmp/after-answer
CGI
/bin/busybox chmod +x /www/cgi-bin/exit /www/cgi-bin/hog
# A worker slow to listen: its container runs, its port answers nothing yet.
[ "${LISTEN_DELAY_SECONDS:-0}" = 0 ] || /bin/busybox sleep "$LISTEN_DELAY_SECONDS"
/bin/busybox nc -ll -p "${PORT:-8080}" -e /front &
server=$!
trap 'hog=$(/bin/busybox head -c "${HOG_MEGABYTES:-256}m" /dev/zero | /bin/busybox tr "\0" x)' USR1
trap '/bin/busybox kill $server' USR2
# The worker's own deadline, with LEASE_SELF_URL (without it, it cannot learn of a
# renewal, so it never stops itself). Every SELF_CHECK_SECONDS it asks the scheduler;
# the latest answer is at GET /self.json. It stops (the server killed, the container
# exits) when the lease has ended, or when the scheduler has not answered and the
# lease's latest known expiry has passed.
epoch() { t=${1%%.*}; /bin/busybox date -u -D '%Y-%m-%dT%H:%M:%S' -d "${t%Z}" +%s; }
stop() { echo "demo worker: $*; stopping"; : > /tmp/stopped; /bin/busybox kill $server; }
(
  deadline=$(epoch "$LEASE_EXPIRES_AT")
  while /bin/busybox sleep "${SELF_CHECK_SECONDS:-2}"; do
    { read -r fence; read -r expires; read -r url; read -r token; } < /tmp/lease.state
    [ -n "$url" ] || continue
    told=$(epoch "$expires" 2>/dev/null) && [ "$told" -gt "$deadline" ] && deadline=$told
    # busybox's own `wget -T` crashes (Debian's 1.35): `timeout` bounds the call.
    if answer=$(/bin/busybox timeout 5 /bin/busybox wget -q -O - \
        --header "Authorization: Bearer $token" "$url" 2>/dev/null); then
      printf '%s\n' "$answer" > /www/self.json
      state=${answer#*\"state\":\"}; state=${state%%\"*}
      expires=${answer#*\"expires_at\":\"}; expires=${expires%%\"*}
      case "$state" in
        releasing|released|failed) stop "lease $state"; exit 0 ;;
      esac
      deadline=$(epoch "$expires")
    elif [ "$(/bin/busybox date -u +%s)" -gt "$deadline" ]; then
      stop "no answer from the scheduler and the lease expired"; exit 0
    fi
  done
) &
# A trapped signal (USR1, USR2) ends `wait` early: wait again while the server runs.
while /bin/busybox kill -0 $server 2>/dev/null; do wait $server; done
[ -e /tmp/exit-code ] && exit "$(/bin/busybox cat /tmp/exit-code)"
[ -e /tmp/stopped ] && exit 0   # stopped itself: a clean exit
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
