#!/usr/bin/env bash
# Make a PostgreSQL server answer on this machine, with a role for the current user and
# a database `openalice_test`, taking as many connections as the parallel test suite
# opens (each scheduler keeps a pool of up to 30; several replicas on several pytest-xdist
# workers at once). Idempotent: when a server already answers with enough connections,
# only the role and database are made when missing. Otherwise, as root on Debian, install
# postgresql when missing, raise max_connections, and start (or restart) the cluster.
set -euo pipefail
say() { printf '[ensure-postgres] %s\n' "$*" >&2; }

# What the suite needs at once, with room to spare (PostgreSQL's default is 100).
NEEDED_CONNECTIONS=500

answers() { pg_isready -q -h "${PGHOST:-/var/run/postgresql}" 2>/dev/null; }

if ! answers; then
  if [ "$(id -u)" != 0 ]; then
    say "no PostgreSQL answers and this is not root: start one yourself (see README)"
    exit 1
  fi
  if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
    say "installing Debian's postgresql"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  fi
  version=$(ls /usr/lib/postgresql | sort -V | tail -1)
  if ! pg_lsclusters -h 2>/dev/null | grep -q "^$version main"; then
    say "creating cluster $version/main"
    pg_createcluster "$version" main >/dev/null
  fi
  pg_conftool -s "$version" main set max_connections "$NEEDED_CONNECTIONS"
  say "starting PostgreSQL $version (max_connections=$NEEDED_CONNECTIONS)"
  pg_ctlcluster "$version" main start
  for _ in $(seq 1 60); do answers && break; sleep 0.5; done
  answers || { say "PostgreSQL did not answer within 30 s"; exit 1; }
else
  have=$(psql -h "${PGHOST:-/var/run/postgresql}" -U postgres -d postgres -tAc "SHOW max_connections" 2>/dev/null \
         || su postgres -c "psql -tAc 'SHOW max_connections'" 2>/dev/null || echo 0)
  if [ "${have:-0}" -ge "$NEEDED_CONNECTIONS" ]; then
    say "a PostgreSQL server already answers ($have connections); leaving it as it is"
  else
    cluster=$(pg_lsclusters -h 2>/dev/null | awk '$4 == "online" { print $1 " " $2; exit }')
    if [ "$(id -u)" != 0 ] || [ -z "$cluster" ]; then
      say "PostgreSQL answers but takes only $have connections; the suite needs $NEEDED_CONNECTIONS:"
      say "  ALTER SYSTEM SET max_connections = $NEEDED_CONNECTIONS; then restart it"
      exit 1
    fi
    say "PostgreSQL $cluster takes only $have connections; raising max_connections to" \
        "$NEEDED_CONNECTIONS and restarting it (the suite opens that many at once)"
    pg_conftool -s $cluster set max_connections "$NEEDED_CONNECTIONS"
    pg_ctlcluster $cluster restart
    for _ in $(seq 1 60); do answers && break; sleep 0.5; done
    answers || { say "PostgreSQL did not answer within 30 s of its restart"; exit 1; }
  fi
fi

user=$(id -un)
if ! su postgres -c "psql -tAc \"SELECT 1 FROM pg_roles WHERE rolname='$user'\"" | grep -q 1; then
  say "creating role $user"
  su postgres -c "psql -qc \"CREATE ROLE \\\"$user\\\" SUPERUSER LOGIN\""
fi
if ! psql -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname='openalice_test'" | grep -q 1; then
  say "creating database openalice_test"
  psql -d postgres -qc "CREATE DATABASE openalice_test"
fi
