"""The Docker side: each sandbox is one real container on the emulator's network.

Blocking docker SDK calls, run by the engine in threads. Every container carries the
emulator instance's label (so that everything it made is found and removed by label,
also after a crash) and its sandbox's id. A container's end is heard from Docker's event
stream (`die`), read in a thread of its own.

A sandbox created without a command runs nothing of its image (Modal: "defaults to
sleeping"): the emulator mounts a tiny static program that only sleeps (x86-64 Linux,
written below byte by byte) and makes it the entrypoint. Images need no shell for it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors

from tests.emulator_docker import InstanceContainers

LABEL_INSTANCE = "openalice.modal-emulator.instance"
LABEL_SANDBOX = "openalice.modal-emulator.sandbox"
LABEL_APP = "openalice.modal-emulator.app"
SLEEPER_PATH = "/.modal-emulator/sleep"
_DOCKER_TIMEOUT = 60


def sleeper_elf() -> bytes:
    """A static x86-64 Linux program: `for (;;) pause();` (exits only when killed)."""
    code = bytes.fromhex("b8220000000f05ebf7")  # mov eax, 34 (pause); syscall; jmp back
    base, header_size = 0x400000, 64 + 56
    size = header_size + len(code)
    elf_header = struct.pack(
        "<4sBBBBB7xHHIQQQIHHHHHH",
        b"\x7fELF",
        2,  # 64-bit
        1,  # little endian
        1,  # ELF version
        0,  # System V ABI
        0,
        2,  # ET_EXEC
        0x3E,  # x86-64
        1,
        base + header_size,  # entry point
        64,  # program headers right after this header
        0,
        0,
        64,
        56,
        1,
        0,
        0,
        0,
    )
    program_header = struct.pack(
        "<IIQQQQQQ", 1, 5, 0, base, base, size, size, 0x1000
    )  # PT_LOAD, R+X, the whole file
    return elf_header + program_header + code


@dataclass
class ContainerSpec:
    sandbox_id: str
    app_id: str
    image: str
    command: list[str] | None  # None: sleep (nothing of the image runs)
    env: dict[str, str]
    workdir: str | None = None
    nano_cpus: int | None = None
    mem_limit_mb: int | None = None
    extra_labels: dict[str, str] = field(default_factory=dict)


class Containers(InstanceContainers):
    """The emulator instance's containers on one Docker engine and network."""

    def __init__(self, instance: str, network: str | None, state_dir: Path) -> None:
        super().__init__(LABEL_INSTANCE, instance, network, timeout=_DOCKER_TIMEOUT)
        self._sleeper = state_dir / "sleep"
        self._sleeper.write_bytes(sleeper_elf())
        self._sleeper.chmod(0o755)

    # --- containers --------------------------------------------------------------------

    def run(self, spec: ContainerSpec) -> tuple[str, str]:
        """Create and start the sandbox's container; its id and address on the network."""
        labels = {
            LABEL_INSTANCE: self.instance,
            LABEL_SANDBOX: spec.sandbox_id,
            LABEL_APP: spec.app_id,
            **spec.extra_labels,
        }
        options: dict[str, Any] = {
            "image": spec.image,
            "environment": spec.env,  # the container's config, never its command line
            "labels": labels,
            "name": f"modal-emu-{self.instance}-{spec.sandbox_id}",
            "detach": True,
            "working_dir": spec.workdir,
            "network": self.network,
        }
        if spec.command is None:
            options["entrypoint"] = [SLEEPER_PATH]
            options["command"] = []
            options["volumes"] = {str(self._sleeper): {"bind": SLEEPER_PATH, "mode": "ro"}}
        else:
            options["command"] = spec.command  # the image's ENTRYPOINT, if any, is kept
        if spec.nano_cpus:
            options["nano_cpus"] = spec.nano_cpus
        if spec.mem_limit_mb:
            options["mem_limit"] = f"{spec.mem_limit_mb}m"
            options["memswap_limit"] = f"{spec.mem_limit_mb}m"  # hard: no swap past it
        container = self._client.containers.create(**options)
        try:
            container.start()
            container.reload()
            settings = container.attrs["NetworkSettings"]
            if self.network is None:
                address = settings.get("IPAddress", "")
            else:
                address = settings["Networks"][self.network]["IPAddress"]
        except Exception:
            self.remove(container.id)
            raise
        return str(container.id), str(address)

    def kill(self, container_id: str) -> bool:
        """SIGKILL its process, as the kernel's OOM killer does (`docker kill`); False if
        it was not running (or is gone)."""
        try:
            self._client.api.kill(container_id, signal="SIGKILL")
        except docker.errors.NotFound:
            return False
        except docker.errors.APIError as exc:
            if exc.status_code == 409:  # "is not running"
                return False
            raise
        return True

    # --- exits -------------------------------------------------------------------------

    def watch_exits(self, on_exit: Callable[[str, int, bool], None]) -> None:
        """Call `on_exit(sandbox_id, exit_code, oom_killed)` (from a thread) as containers
        end; a container the kernel OOM-killed once Docker has said so (`watch_dies`)."""

        def heard(labels: dict[str, str], _container_id: str, code: int, oom: bool) -> None:
            if sandbox_id := labels.get(LABEL_SANDBOX):
                on_exit(sandbox_id, code, oom)

        self.watch_dies(heard)
