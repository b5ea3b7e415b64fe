"""A guard (`openalice-scheduler guard`) as a real process beside a test's scheduler, and
a TCP proxy between them that a test can cut (the guard alone cut off)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

from tests.forked import Forked
from tests.harness import Scheduler, free_port, kill_process, spawn_command

# Short enough for a test, each a knob of its own: poll 0.5 s, silence 3 s, grace 2 s.
FAST = {"GUARD_POLL_SECONDS": "0.5", "GUARD_SILENCE_SECONDS": "3", "GUARD_GRACE_SECONDS": "2"}


class GuardProcess:
    """A guard with the scheduler's own provider settings (what a deployment gives it),
    polling `url` (the scheduler's unless given), its state in the test's directory."""

    def __init__(
        self, sched: Scheduler, name: str = "guard", url: str | None = None, **env: str
    ) -> None:
        self.name = name
        self.state_file = sched.workdir / f"{name}-{sched.instance}.json"
        self.log_path = sched.workdir / f"{name}-{sched.instance}.log"
        self.env = {
            **sched.env,
            "GUARD_SCHEDULER_URL": url or sched.url,
            "GUARD_ID": f"{name}-{sched.instance}",
            "GUARD_STATE_FILE": str(self.state_file),
            **FAST,
            **env,
        }
        self.workdir = sched.workdir
        self.proc: Forked | None = None

    @property
    def guard_id(self) -> str:
        return self.env["GUARD_ID"]

    def start(self) -> GuardProcess:
        self.proc = spawn_command("guard", self.env, self.log_path, self.workdir)
        return self

    def kill(self) -> None:
        """kill -9: nothing of the guard's own runs."""
        kill_process(self.proc)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class CutProxy:
    """Forwards 127.0.0.1:<port> to `target_port`; `cut()` closes the listener and every
    connection (the guard's polls find nobody), `mend()` listens again."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def __enter__(self) -> CutProxy:
        self._thread.start()
        self.mend()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def cut(self) -> None:
        self._call(self._cut())

    def mend(self) -> None:
        self._call(self._listen())

    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)  # type: ignore[arg-type]

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(
            self._pipe, "127.0.0.1", self.port, family=socket.AF_INET
        )

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))
        self._writers -= {writer, up_writer}
