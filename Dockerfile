# The service's own image: openalice-scheduler:<version>. Build it with
# scripts/build-image.sh, which first builds the wheels on the host (build/wheelhouse/):
# nothing here reaches a package index, so the build needs no network
# (docs/operations/image.md#run-the-image). Only Dockerfile syntax the classic builder knows too (no
# RUN --mount), as Debian's engine may have no BuildKit.
#
# BASE: any Debian-like image with python3 and its venv module, of the Python version
# the wheels were built for. Users get the official slim image; a host without a
# registry makes one from Debian's packages (scripts/build-image.sh --debian-base).
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
# The locked dependencies first, then the project's own wheel: editing the code rebuilds
# only the last, small layers.
COPY build/wheelhouse/deps /wheels/deps
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --no-index --disable-pip-version-check \
         /wheels/deps/*.whl
COPY build/wheelhouse/app /wheels/app
# Installed with its [server] extra and no index: a wheel missing from the wheelhouse
# fails the build here, not the container at start-up. The service installs nothing at
# run time, so pip and setuptools go (22 MB).
RUN /opt/venv/bin/pip install --no-cache-dir --no-index --disable-pip-version-check \
         --find-links /wheels/deps \
         "openalice-scheduler[server] @ file://$(ls /wheels/app/openalice_scheduler-*.whl)" \
    && /opt/venv/bin/openalice-scheduler --version \
    && /opt/venv/bin/python -m pip uninstall -y -q pip setuptools
# Marks this stage's last image, which the classic builder keeps untagged as the cache of
# the next build: scripts/build-image.sh removes those of earlier builds.
LABEL org.openalice.scheduler.stage=build

# The image itself: the base, a user and the virtualenv; no wheels, no pip cache.
FROM ${BASE}
ARG VERSION=unknown
LABEL org.opencontainers.image.title="openalice-scheduler" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.description="GPU/compute lease service"
# A fixed uid/gid, so a bind-mounted /data can be chowned to it ahead of time. The Docker
# socket is not this user's: give the container the socket's group with
# `--group-add $(stat -c %g /var/run/docker.sock)` (compose: group_add).
RUN groupadd --system --gid 10001 openalice \
    && useradd --system --uid 10001 --gid openalice --home-dir /data --no-create-home \
         --shell /usr/sbin/nologin openalice \
    && mkdir /data && chown openalice:openalice /data
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    DATABASE_URL=sqlite:////data/openalice-scheduler.db \
    SCHEDULER_HOST=0.0.0.0 \
    SCHEDULER_PORT=8080
# A new named volume starts as a copy of /data, so it is the user's from the start.
VOLUME /data
WORKDIR /data
USER openalice:openalice
EXPOSE 8080
# Liveness only (/health answers while the process serves); no curl in the image, so
# Python asks, on the port the service was told to listen on.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SCHEDULER_PORT', '8080') + '/health', timeout=4)"]
# `docker run IMAGE` serves; `docker run IMAGE --version` (or any other command of the
# CLI, e.g. `lease ls`) replaces only the default argument.
ENTRYPOINT ["openalice-scheduler"]
CMD ["serve"]
