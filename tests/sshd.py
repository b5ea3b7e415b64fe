"""An SSH server of the tests' own, in front of a Docker engine, as a remote host reached
with `ssh://user@host` is: OpenSSH's sshd on a loopback port, with a host key and one
client key of its own, whose sessions reach `docker_host` (sshd's `SetEnv`), so that
`docker system dial-stdio` there talks to that engine. And the client side: an `ssh` on a
PATH directory of its own that uses this server's known host key and client key, as the
scheduler's user would have them in `~/.ssh`."""

from __future__ import annotations

import getpass
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from tests.harness import free_port, stop_process, wait_for


class PrivateSshd:
    def __init__(self, docker_host: str, delay: float = 0.0) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="oa-ssh-", dir="/tmp"))
        self.docker_host = docker_host
        # Seconds the next ssh connection takes before it even starts (a far host's
        # handshake), once `slow` exists (`slow_next`).
        self.delay = delay
        self.slow = self.root / "slow"
        self.user = getpass.getuser()
        self.port = free_port()
        self.url = f"ssh://{self.user}@127.0.0.1:{self.port}"
        # Put first on the scheduler's PATH: its `ssh` knows this server and its key.
        self.client_bin = self.root / "bin"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateSshd:
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        for key in ("host_key", "client_key"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.root / key)],
                check=True,
                capture_output=True,
            )
        (self.root / "authorized_keys").write_text((self.root / "client_key.pub").read_text())
        (self.root / "sshd_config").write_text(
            f"ListenAddress 127.0.0.1\nPort {self.port}\n"
            f"HostKey {self.root / 'host_key'}\n"
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}\n"
            f"PidFile {self.root / 'sshd.pid'}\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
            f"SetEnv DOCKER_HOST={self.docker_host}\n"
        )
        host_key = (self.root / "host_key.pub").read_text().split()
        (self.root / "known_hosts").write_text(
            f"[127.0.0.1]:{self.port} {host_key[0]} {host_key[1]}\n"
        )
        (self.root / "ssh_config").write_text(
            f"Host 127.0.0.1\n  IdentityFile {self.root / 'client_key'}\n"
            f"  UserKnownHostsFile {self.root / 'known_hosts'}\n"
            "  StrictHostKeyChecking yes\n  BatchMode yes\n"
        )
        self.client_bin.mkdir()
        wrapper = self.client_bin / "ssh"
        pause = (
            f"if rm {self.slow} 2>/dev/null; then sleep {self.delay}; fi\n" if self.delay else ""
        )
        wrapper.write_text(
            f"#!/bin/sh\n{pause}exec {shutil.which('ssh') or '/usr/bin/ssh'} "
            f'-F {self.root / "ssh_config"} "$@"\n'
        )
        wrapper.chmod(0o755)
        # sshd wants its privilege separation directory.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        log = open(self.root / "sshd.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [sshd, "-D", "-e", "-f", str(self.root / "sshd_config")],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        wait_for(self._answers, 30, interval=0.1, what=f"sshd on port {self.port}")
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                return s.recv(64).startswith(b"SSH-")
        except OSError:
            return False

    def slow_next(self) -> None:
        """The next ssh connection takes `delay` seconds more."""
        self.slow.touch()

    def log(self) -> str:
        return (self.root / "sshd.log").read_text(errors="replace")

    def destroy(self) -> None:
        stop_process(self.proc, grace=10)
        shutil.rmtree(self.root, ignore_errors=True)
