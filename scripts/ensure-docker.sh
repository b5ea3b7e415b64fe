#!/usr/bin/env bash
# Make a Docker engine answer on this machine. Idempotent: when an engine already
# answers, nothing is changed. Otherwise, as root on Debian, install docker.io when it is
# missing and start dockerd in the background.
set -euo pipefail

say() { printf '[ensure-docker] %s\n' "$*" >&2; }

engine_answers() { timeout 5 docker info >/dev/null 2>&1 || python3 - <<'PY' 2>/dev/null
import socket, sys
s = socket.socket(socket.AF_UNIX); s.settimeout(3)
s.connect("/var/run/docker.sock"); s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
sys.exit(0 if b"OK" in s.recv(4096) else 1)
PY
}

if engine_answers; then
  say "a Docker engine already answers; leaving it as it is"
  exit 0
fi

if [ "$(id -u)" != 0 ]; then
  say "no Docker engine answers and this is not root: start one yourself (see README)"
  exit 1
fi

if ! command -v dockerd >/dev/null 2>&1; then
  say "installing Debian's docker.io"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
fi

say "starting dockerd (log: /var/log/dockerd.log)"
setsid dockerd >/var/log/dockerd.log 2>&1 < /dev/null &
for _ in $(seq 1 60); do
  if engine_answers; then say "dockerd is ready"; exit 0; fi
  sleep 0.5
done
say "dockerd did not answer within 30 s; see /var/log/dockerd.log"
tail -20 /var/log/dockerd.log >&2 || true
exit 1
