#!/usr/bin/env bash
# Build the service's image, openalice-scheduler:<version> and :latest
# (docs/operations/image.md#run-the-image). The wheels are built here on the host, where the package
# index is reachable (the service's [server] extra at the versions requirements.lock pins, and the
# project's own wheel, in build/wheelhouse/); the image build then installs them with no index, so
# it needs no network.
#
#   scripts/build-image.sh                     # FROM python:3.11-slim (pulled)
#   scripts/build-image.sh --base IMAGE        # FROM an image already on the engine
#   scripts/build-image.sh --debian-base       # no registry: a base made from Debian's
#                                              # packages (mmdebstrap), kept as
#                                              # openalice-base:bookworm for next time
#   ... [--repository NAME]                    # tag NAME:<version>, NAME:latest instead
#   ... [--rebuild]                            # build even when nothing it is made of changed
#
# An image already built from the same inputs (the base image, the package's files, the
# lock, the Dockerfile: label org.openalice.scheduler.inputs) is kept as it is.
# PYTHON is the interpreter that builds the wheels (default: .venv/bin/python, else
# python3); it must be the base image's Python version (checked), as some dependencies
# are compiled per version.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[build-image] %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

base=python:3.11-slim
repository=openalice-scheduler
debian_base=openalice-base:bookworm
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base="${2:?--base needs an image}"; shift 2 ;;
    --debian-base) base="$debian_base"; make_debian_base=1; shift ;;
    --repository) repository="${2:?--repository needs a name}"; shift 2 ;;
    --rebuild) rebuild=1; shift ;;
    -h|--help) awk 'NR > 1 { if (!/^#/) exit; sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
version=$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')

# The classic builder when BuildKit's client (buildx) is missing, as with Debian's
# docker.io: the Dockerfile needs nothing more.
if ! docker buildx version >/dev/null 2>&1; then
  export DOCKER_BUILDKIT=0
fi

make_debian_base() {
  if docker image inspect "$debian_base" >/dev/null 2>&1; then
    say "$debian_base already present"
    return
  fi
  # mmdebstrap, not debootstrap: it resolves and unpacks with apt and dpkg instead of shell
  # and perl, and writes the tree as a tarball straight into `docker import` (measured on 2
  # cores: 26 s and 26 CPU-s where debootstrap took 49 s and 54 CPU-s, for the same tree).
  if ! command -v mmdebstrap >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || die "mmdebstrap is missing; install it (apt-get install mmdebstrap)"
    say "installing mmdebstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
  fi
  [ "$(id -u)" = 0 ] || die "mmdebstrap needs root here to make $debian_base"
  # The Debian mirror apt already uses here (sources.list or deb822 .sources).
  local mirror
  mirror=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
             /etc/apt/sources.list.d/*.sources \
           | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -1 | tr -d ' ' || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  local log
  log=$(mktemp)
  # shellcheck disable=SC2064 # expand now: the local is gone when the trap runs
  trap "rm -f '$log'" EXIT
  say "making $debian_base with mmdebstrap from $mirror (about half a minute)"
  # The minimal base with Python and its venv module; mmdebstrap leaves no apt lists or
  # downloaded packages in it. Its merged-usr hook makes /bin, /lib and /sbin links into
  # /usr as debootstrap does, with usr-is-merged (without it, the usrmerge package and the
  # Perl it needs come too: 217 MB instead of 169).
  mmdebstrap --variant=minbase --include=python3,python3-venv \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr bookworm - "$mirror" 2>"$log" \
    | docker import --change 'CMD ["python3"]' - "$debian_base" >/dev/null \
    || { tail -20 "$log" >&2; die "mmdebstrap or docker import failed"; }
  rm -f "$log"
  say "made $debian_base"
}

if [ "${make_debian_base:-0}" = 1 ]; then
  make_debian_base
fi

# The wheels must be of the base's Python (cp311 wheels do not load on 3.12).
base_python=$(docker run --rm --entrypoint python3 "$base" \
                -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
  || die "cannot run python3 in $base (not on the engine and no registry? try --debian-base)"
host_python=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$base_python" = "$host_python" ] \
  || die "$base has Python $base_python but $PYTHON is $host_python: set PYTHON=python$base_python"

# What the image is made of, as one hash: the base image, then every file the wheel and
# the build read (not caches, not the git metadata).
inputs=$( { docker image inspect -f '{{.Id}}' "$base"
            find src pyproject.toml requirements.lock README.md Dockerfile .dockerignore \
              scripts/build-image.sh \
              -type f ! -path '*/__pycache__/*' ! -path '*.egg-info/*' 2>/dev/null \
              | LC_ALL=C sort | xargs sha256sum; } | sha256sum | cut -c1-16)
built_from=$(docker image inspect -f '{{ index .Config.Labels "org.openalice.scheduler.inputs" }}' \
               "$repository:$version" 2>/dev/null || true)
if [ "${rebuild:-0}" != 1 ] && [ "$built_from" = "$inputs" ] \
   && [ "$(docker image inspect -f '{{.Id}}' "$repository:latest" 2>/dev/null)" \
        = "$(docker image inspect -f '{{.Id}}' "$repository:$version")" ]; then
  say "$repository:$version is already built from these inputs ($inputs); --rebuild builds it again"
  exit 0
fi

wheelhouse=build/wheelhouse
# uv, where the virtualenv has it (scripts/install-venv.sh puts it there).
uv=$(dirname "$PYTHON")/uv
# The dependencies' wheels: with uv, it resolves the [server] extra within the lock and
# lists each chosen package's files (a pylock.toml, PEP 751), and pip fetches the wheels
# from that list alone, nothing to resolve (--no-deps) and no index to read. pip alone
# reads and weighs every file the index lists for each project, some 90,000 for these 83
# (measured on 2 cores: 30 s and 28 CPU-s; so, 4 s). The same wheels either way; pip alone
# where there is no uv, or it fails (a host whose only index is in pip's configuration,
# which uv does not read).
deps_with_uv() {
  [ -x "$uv" ] || return 1
  "$uv" pip compile -q pyproject.toml --extra server -c requirements.lock --python "$PYTHON" \
    --format pylock.toml -o "$wheelhouse/pylock.toml" || return 1
  "$PYTHON" - "$wheelhouse" <<'PY' || return 1
import sys
import tomllib
from html import escape
from pathlib import Path

wheelhouse = Path(sys.argv[1])
lock = tomllib.loads((wheelhouse / "pylock.toml").read_text())
pins, links = [], []
for package in lock["packages"]:
    pins.append(f"{package['name']}=={package['version']}")
    for file in [*package.get("wheels", []), *filter(None, [package.get("sdist")])]:
        href = f"{file['url']}#sha256={file['hashes']['sha256']}"
        links.append(f'<a href="{escape(href)}">{escape(file["url"].rsplit("/", 1)[-1])}</a>')
(wheelhouse / "server.txt").write_text("\n".join(pins) + "\n")
(wheelhouse / "links.html").write_text("<!DOCTYPE html>\n" + "<br>\n".join(links) + "\n")
PY
  "$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps --no-index \
    --find-links "$wheelhouse/links.html" -r "$wheelhouse/server.txt" -w "$wheelhouse/deps"
}
deps_with_pip() {
  "$PYTHON" -m pip wheel -q --disable-pip-version-check -c requirements.lock \
    -w "$wheelhouse/deps" '.[server]'
  rm -f "$wheelhouse"/deps/openalice_scheduler-*.whl
}
# The dependencies' wheels are built again only when what they come from changes.
stamp=$(cat pyproject.toml requirements.lock | sha256sum | cut -c1-16)-py$host_python
if [ "$(cat "$wheelhouse/deps/.stamp" 2>/dev/null)" != "$stamp" ]; then
  say "building the dependencies' wheels (server extra, requirements.lock) in $wheelhouse/deps"
  rm -rf "$wheelhouse/deps"
  mkdir -p "$wheelhouse/deps"
  if ! deps_with_uv; then
    [ ! -x "$uv" ] || say "uv could not list the wheels: pip finds them on the index instead"
    rm -rf "$wheelhouse/deps"
    deps_with_pip
  fi
  echo "$stamp" > "$wheelhouse/deps/.stamp"
fi
say "building the project's wheel in $wheelhouse/app"
# setuptools builds in build/lib and keeps what is there: a module deleted since the last
# build would ship again.
rm -rf "$wheelhouse/app" build/lib build/bdist.*
# uv builds it in an isolated environment from its cache (~1.5 s; pip's own, ~4 s).
if ! { [ -x "$uv" ] && "$uv" build -q --wheel -o "$wheelhouse/app" .; }; then
  rm -rf "$wheelhouse/app" build/lib build/bdist.*
  "$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps -w "$wheelhouse/app" .
fi

previous=$(docker image inspect --format '{{.Id}}' "$repository:latest" 2>/dev/null || true)
say "building $repository:$version FROM $base"
docker build --build-arg BASE="$base" --build-arg VERSION="$version" \
  --label "org.openalice.scheduler.inputs=$inputs" \
  -t "$repository:$version" -t "$repository:latest" . >&2
current=$(docker image inspect --format '{{.Id}}' "$repository:latest")
# The image this one replaces, unless a container still uses it (then it stays).
if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
  docker image rm "$previous" >/dev/null 2>&1 || true
fi
# The classic builder keeps each build stage's result untagged, as cache: keep the newest
# (this build's), remove older ones (their shared layers stay).
docker images -q --no-trunc --filter dangling=true --filter label=org.openalice.scheduler.stage=build \
  | tail -n +2 | xargs -r docker image rm >/dev/null 2>&1 || true
say "built $repository:$version and $repository:latest"
