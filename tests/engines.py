"""Docker engines of the tests' own: a dockerd process next to the shared one, that a test
may stop for real (tests/test_faults.py), or that accepts GPU device requests on a
machine without GPUs (the session's `gpu_engine` fixture in tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import docker

from tests import procs
from tests.harness import INSTANCE_LABEL, WORKER_IMAGE, docker_client, list_containers, wait_for

# Docker accepts a device request with the `gpu` capability only when this binary is on
# dockerd's PATH when it starts; runc then runs it as a prestart hook of the container.
GPU_HOOK = "nvidia-container-runtime-hook"
_NO_OP_HOOK = """#!/bin/sh
# Test shim: accepts Docker's GPU device requests on a machine without GPUs.
cat >/dev/null
exit 0
"""


_CHOSEN: set[int] = set()
_CLAIMS = Path("/tmp/oa-test-routes")


def _claim_octet(octet: int) -> bool:
    """Claim `octet` for this process: a lock file holding its pid, made with O_EXCL.
    A claim whose process is gone (a run killed) is taken over."""
    _CLAIMS.mkdir(exist_ok=True)
    path = _CLAIMS / str(octet)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            with contextlib.suppress(OSError, ValueError):
                holder = int(path.read_text() or "0")
                if holder == os.getpid() or Path(f"/proc/{holder}").exists():
                    return False
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # its process is gone
            continue
        with os.fdopen(fd, "w") as claim:
            claim.write(str(os.getpid()))
        return True
    return False


class Route:
    """The way from the host's network namespace to the bridge networks of an engine in
    a namespace of its own, as to a routed host of a fleet: a veth pair between the
    namespaces, forwarding in the engine's, and on the host a route to `pool` (the
    engine's --default-address-pool) through it. Made again at each start of the engine,
    whose namespace is new each time; gone with the namespace."""

    def __init__(self, second_octet: int) -> None:
        self.pool = f"10.{second_octet}.0.0/16"
        self.host_end, self.engine_end = f"10.{second_octet}.255.1", f"10.{second_octet}.255.2"
        self.names = (f"oa{second_octet}h", f"oa{second_octet}n")

    @classmethod
    def unused(cls) -> Route:
        """A Route whose pool no route of the host's overlaps yet, and that no other test
        process (a pytest-xdist worker) has chosen: each choice is a lock file of its
        own, made atomically and kept until this process ends."""
        taken = subprocess.run(
            ["ip", "route", "show"], capture_output=True, text=True, check=True
        ).stdout
        for octet in random.sample(range(200, 250), 50):
            if f"10.{octet}." in taken or octet in _CHOSEN or not _claim_octet(octet):
                continue
            _CHOSEN.add(octet)  # another engine of this process may not be started yet
            return cls(octet)
        raise AssertionError("no free 10.2xx.0.0/16 for a private engine's networks")

    def connect(self, pid: int) -> None:
        host, inner = self.names
        inside = ["nsenter", "-t", str(pid), "-n"]
        subprocess.run(["ip", "link", "del", host], capture_output=True, check=False)
        for command in (
            ["ip", "link", "add", host, "type", "veth", "peer", "name", inner],
            ["ip", "link", "set", inner, "netns", str(pid)],
            ["ip", "addr", "add", f"{self.host_end}/30", "dev", host],
            ["ip", "link", "set", host, "up"],
            [*inside, "ip", "addr", "add", f"{self.engine_end}/30", "dev", inner],
            [*inside, "ip", "link", "set", inner, "up"],
            [*inside, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
            ["ip", "route", "replace", self.pool, "via", self.engine_end, "dev", host],
        ):
            subprocess.run(command, capture_output=True, check=True)


class Engine:
    """A dockerd process: stopped with SIGTERM, started again with the very argv and
    environment it had (read from /proc), in a session of its own like `setsid dockerd`.
    With `own_netns`, it is started in a fresh network namespace (`unshare --net`),
    reachable from the host's through `route` when given."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        sock: str,
        log: Path,
        own_netns: bool = False,
        route: Route | None = None,
    ) -> None:
        self.argv, self.env, self.sock, self.log = argv, env, sock, log
        self.own_netns = own_netns
        self.route = route
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None

    @classmethod
    def capture(
        cls, pid: int, sock: str, log: Path, own_netns: bool = False, route: Route | None = None
    ) -> Engine:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
        engine = cls([a.decode() for a in argv if a], env, sock, log, own_netns, route)
        engine.pid = pid
        return engine

    def answers(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(3)
                s.connect(self.sock)
                s.sendall(b"GET /_ping HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n")
                return b" 200 " in s.recv(4096)
        except OSError:
            return False

    def running(self) -> bool:
        return self.pid is not None and procs.running(self.pid)

    def start(self, timeout: float = 90) -> None:
        with open(self.log, "ab") as log:
            # `unshare` execs dockerd: the child's pid is dockerd's.
            prefix = ["unshare", "--net", "--"] if self.own_netns else []
            self.proc = subprocess.Popen(
                [*prefix, *self.argv],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # what `setsid` does
            )
        self.pid = self.proc.pid
        try:
            wait_for(self.answers, timeout, interval=0.2, what=f"dockerd on {self.sock}")
        except AssertionError as exc:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"{exc}; dockerd log ends:\n{tail}") from None
        if self.route is not None:
            self.route.connect(self.pid)

    def stop(self, timeout: float = 90) -> None:
        """SIGTERM and wait until it has exited and its socket no longer answers.
        (dockerd stops the running containers first: about 10 s each at most, in
        parallel.)"""
        if self.pid is not None and self.running():
            os.kill(self.pid, signal.SIGTERM)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        wait_for(lambda: not self.running(), timeout, interval=0.2, what="dockerd to exit")
        wait_for(lambda: not self.answers(), timeout, interval=0.2, what="the socket to go quiet")

    def kill(self) -> None:
        if self.pid is not None and self.running():
            os.kill(self.pid, signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)


class PrivateEngine:
    """A second, private Docker engine: the shared engine's binary with its own data
    root, exec root, socket and pid file, and its own network namespace, holding a copy
    of the worker image. The scheduler only needs its unix socket.

    The namespace matters: a second dockerd in the host's namespace deletes the shared
    engine's `docker0` (with `--bridge=none`, or when it restarts with
    `--default-address-pool`). In its own namespace its `docker0` and the bridge
    networks the scheduler creates (DOCKER_NETWORK) are its own, from an address pool
    of its own (10.2xx.0.0/16), with no collision with the shared engine's; a Route
    makes them reachable from the host, as a fleet's routed hosts are, so that the
    scheduler probes its workers there
    (docs/concepts/readiness-and-loss.md#workers-ready-when-handed-out).

    With `gpu_shim`, a no-op `nvidia-container-runtime-hook` of its own is first on its
    PATH, so it accepts GPU device requests whatever the shared engine was started
    with (tests only: never on a real GPU host)."""

    def __init__(self, gpu_shim: bool = False, tls: bool = False) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="oa-eng-", dir="/tmp"))
        self.sock = str(self.root / "docker.sock")  # unix socket paths: 107 bytes at most
        self.pidfile = self.root / "docker.pid"
        self.url = f"unix://{self.sock}"
        self.gpu_shim = gpu_shim
        self.route = Route.unused()
        # With `tls`, it also listens on TCP with TLS, verifying its callers, as a remote
        # engine does (`dockerd --tlsverify`): at `tcp_url`, through the route, with the
        # client's files (ca.pem, cert.pem, key.pem) in `tls_dir`.
        self.tls = tls
        self.tcp_url = f"tcp://{self.route.engine_end}:{TLS_PORT}"
        self.tls_dir = self.root / "client-tls"
        self.engine: Engine | None = None
        self._client: docker.DockerClient | None = None

    def start(self) -> PrivateEngine:
        argv = [
            shutil.which("dockerd") or "dockerd",
            "--data-root",
            str(self.root / "data"),
            "--exec-root",
            str(self.root / "x"),
            "--pidfile",
            str(self.pidfile),
            "-H",
            self.url,
            "--iptables=false",
            "--ip-forward=false",
            # Its networks from a pool of its own, routed from the host (Route).
            "--default-address-pool",
            f"base={self.route.pool},size=24",
        ]
        if self.tls:
            server = make_tls_files(self.root / "tls", self.route.engine_end)
            argv += [
                "-H",
                f"tcp://0.0.0.0:{TLS_PORT}",
                "--tlsverify",
                "--tlscacert",
                str(server / "ca.pem"),
                "--tlscert",
                str(server / "server-cert.pem"),
                "--tlskey",
                str(server / "server-key.pem"),
            ]
            self.tls_dir.mkdir()
            for name in ("ca.pem", "cert.pem", "key.pem"):
                shutil.copy(server / name, self.tls_dir / name)
        env = dict(os.environ)
        if self.gpu_shim:
            shim_dir = self.root / "gpu-shim"
            shim_dir.mkdir()
            hook = shim_dir / GPU_HOOK
            hook.write_text(_NO_OP_HOOK)
            hook.chmod(0o755)
            env["PATH"] = f"{shim_dir}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        self.engine = Engine(
            argv, env, self.sock, self.root / "dockerd.log", own_netns=True, route=self.route
        )
        self.engine.start()
        # The worker image, copied from the shared engine: no registry is needed.
        image = b"".join(docker_client().images.get(WORKER_IMAGE).save(named=True))
        self.client.images.load(image)
        return self

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            self._client = docker.DockerClient(base_url=self.url, version="1.41", timeout=120)
        return self._client

    def containers(self, instance: str) -> list[Any]:
        return list_containers(
            self.client, all=True, filters={"label": f"{INSTANCE_LABEL}={instance}"}
        )

    def running_pid(self) -> int:
        return int(self.pidfile.read_text().strip())

    def adopt(self, engine: Engine) -> None:
        """`engine` (captured from /proc and restarted) is now the running one."""
        if self.engine is not None and self.engine.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.engine.proc.wait(30)  # reap the first process, stopped meanwhile
        self.engine = engine

    def __enter__(self) -> PrivateEngine:
        """Started; destroyed again when it could not start."""
        try:
            return self.start()
        except BaseException:
            self.destroy()
            raise

    def __exit__(self, *_exc: object) -> None:
        self.destroy()

    def destroy(self) -> None:
        if self.engine is not None:
            with contextlib.suppress(Exception):
                if self.engine.answers():
                    for container in self.client.containers.list(all=True):
                        container.remove(force=True)
            with contextlib.suppress(Exception):
                self.engine.stop(timeout=60)
            self.engine.kill()
        if self._client is not None:
            self._client.close()
        # Anything left of it (its containerd, shims) runs from our private directory.
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                with contextlib.suppress(OSError):
                    if str(self.root).encode() in (proc / "cmdline").read_bytes():
                        os.kill(int(proc.name), signal.SIGKILL)
        with open("/proc/mounts") as mounts:
            targets = [line.split()[1] for line in mounts if str(self.root) in line]
        for target in sorted(targets, key=len, reverse=True):
            subprocess.run(["umount", "-l", target], check=False, capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


# The port of a TLS engine's TCP listener (Docker's own convention for TLS).
TLS_PORT = 2376


def make_tls_files(where: Path, address: str) -> Path:
    """A certificate authority of its own, a server certificate for `address` and a
    client certificate, as Docker's "Protect the Docker daemon socket" page makes them
    with openssl: ca.pem, server-cert.pem, server-key.pem, cert.pem, key.pem in `where`."""
    where.mkdir(parents=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-keyout",
        "ca-key.pem",
        "-out",
        "ca.pem",
        "-subj",
        "/CN=openalice test CA",
    )
    for name, subject, usage in (
        ("server", f"/CN={address}", f"subjectAltName=IP:{address}\nextendedKeyUsage=serverAuth"),
        ("client", "/CN=openalice scheduler", "extendedKeyUsage=clientAuth"),
    ):
        (where / f"{name}.ext").write_text(usage + "\n")
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}-key.pem",
            "-out",
            f"{name}.csr",
            "-subj",
            subject,
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            f"{name}-cert.pem",
            "-extfile",
            f"{name}.ext",
        )
    (where / "client-cert.pem").rename(where / "cert.pem")
    (where / "client-key.pem").rename(where / "key.pem")
    return where
