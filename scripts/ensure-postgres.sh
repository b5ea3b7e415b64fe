#!/usr/bin/env bash
# Make a PostgreSQL server answer on this machine, with a role for the current user and
# a database `openalice_test`. Idempotent: when a server already answers, only the role
# and database are made when missing. Otherwise, as root on Debian, install
# postgresql when missing and start the cluster.
set -euo pipefail
say() { printf '[ensure-postgres] %s\n' "$*" >&2; }

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
  say "starting PostgreSQL $version"
  pg_ctlcluster "$version" main start
  for _ in $(seq 1 60); do answers && break; sleep 0.5; done
  answers || { say "PostgreSQL did not answer within 30 s"; exit 1; }
else
  say "a PostgreSQL server already answers; leaving it as it is"
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
