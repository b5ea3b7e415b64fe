"""A PostgreSQL server of a test's own (the `private_pg` fixture), for the tests that
stop and start their database while the service runs."""

from __future__ import annotations

import getpass
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest


class PrivatePostgres:
    """A PostgreSQL server of this test's own: initdb in a temp directory, unix socket
    only (no TCP port), the same binaries as the shared server. Stopping it disturbs no
    other test. As root, the server runs as the `postgres` user (it refuses root)."""

    def __init__(self) -> None:
        found = sorted(
            Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
            key=lambda p: int(p.parent.parent.name),
        )
        if not found:
            pytest.fail(
                "PostgreSQL server binaries not found: run scripts/ensure-postgres.sh",
                pytrace=False,
            )
        self.bin = found[-1].parent
        self.root = Path(tempfile.mkdtemp(prefix="oa-pg-", dir="/tmp"))
        self.data = self.root / "data"
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            os.chown(self.root, pwd.getpwnam("postgres").pw_uid, -1)
        self.user = getpass.getuser()
        self.url = f"postgresql://{self.user}@/oa?host={self.root}"

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        prefix = ["runuser", "-u", "postgres", "--"] if self.as_postgres else []
        done = subprocess.run([*prefix, *argv], capture_output=True, timeout=120)
        if check and done.returncode != 0:
            raise AssertionError(f"{argv[0]} failed: {done.stderr.decode()[-2000:]}")
        return done

    def _on_data(
        self, program: str, *argv: str, check: bool = True
    ) -> subprocess.CompletedProcess[bytes]:
        """One of the server's programs (initdb, pg_ctl) on this server's data directory."""
        return self._run(str(self.bin / program), "-D", str(self.data), *argv, check=check)

    def _psql(self, sql: str) -> None:
        subprocess.run(
            ["psql", "-h", str(self.root), "-U", "postgres", "-d", "postgres", "-qc", sql],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def init(self) -> PrivatePostgres:
        self._on_data("initdb", "-A", "trust", "-U", "postgres", "--no-sync")
        self.start()
        if self.user != "postgres":
            self._psql(f'CREATE ROLE "{self.user}" SUPERUSER LOGIN')
        self._psql("CREATE DATABASE oa")
        return self

    def start(self) -> None:
        self._on_data(
            "pg_ctl",
            "-l",
            str(self.root / "postgres.log"),
            "-w",
            "-t",
            "60",
            "-o",
            f"-k {self.root} -c listen_addresses='' -c max_connections=200",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        """`fast`: what `pg_ctlcluster … stop` does (sessions cut, transactions rolled
        back); `immediate`: a crash."""
        self._on_data("pg_ctl", "-m", mode, "-w", "-t", "60", "stop")

    def running(self) -> bool:
        return self._on_data("pg_ctl", "status", check=False).returncode == 0

    def destroy(self) -> None:
        if self.data.exists() and self.running():
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
