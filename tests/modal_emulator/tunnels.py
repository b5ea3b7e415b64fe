"""Tunnels: a sandbox's exposed port, served on the tunnel host as Modal serves it.

Each exposed port gets a TLS-terminating TCP proxy on `<tunnel host>:<port of its own>`
(the client builds `https://host:port` from it) with the emulator's certificate, which
forwards the plain bytes to the container's address and port on the emulator's Docker
network. A port asked for as unencrypted also gets a plain TCP proxy (Modal's
`unencrypted_host`/`unencrypted_port`). A connection made while nothing listens in the
container is closed at once (after the TLS handshake), as a port that does not answer
yet. Closing a tunnel (its sandbox ended) drops its open connections too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass, field

_CONNECT_TIMEOUT = 5.0
_CHUNK = 64 * 1024


@dataclass
class Tunnel:
    """One exposed port of one sandbox."""

    container_port: int
    encrypted: bool
    h2: bool
    host: str
    tls_port: int = 0
    tcp_port: int = 0  # 0: no plain endpoint (an encrypted port)
    connections: int = 0  # connections accepted, both endpoints
    _servers: list[asyncio.Server] = field(default_factory=list, repr=False)
    _streams: set[asyncio.StreamWriter] = field(default_factory=set, repr=False)

    def as_dict(self) -> dict[str, object]:
        return {
            "container_port": self.container_port,
            "encrypted": self.encrypted,
            "h2": self.h2,
            "url": f"https://{self.host}:{self.tls_port}",
            "tls_port": self.tls_port,
            "tcp_port": self.tcp_port or None,
            "connections": self.connections,
        }

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for writer in list(self._streams):
            writer.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._servers.clear()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, ssl.SSLError, OSError):
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()


async def _proxy(
    tunnel: Tunnel,
    target: tuple[str, int],
    client_reader: asyncio.StreamReader,
    client_writer: asyncio.StreamWriter,
) -> None:
    tunnel.connections += 1
    tunnel._streams.add(client_writer)
    writers = [client_writer]
    try:
        try:
            upstream_reader, upstream_writer = await asyncio.wait_for(
                asyncio.open_connection(*target), _CONNECT_TIMEOUT
            )
        except (OSError, TimeoutError):
            return  # nothing listens (yet): the caller sees the connection closed
        writers.append(upstream_writer)
        tunnel._streams.add(upstream_writer)
        pumps = [
            asyncio.ensure_future(_pump(client_reader, upstream_writer)),
            asyncio.ensure_future(_pump(upstream_reader, client_writer)),
        ]
        # Either side done (an HTTP/1.1 server closing after its answer, say): both close.
        _, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        for writer in writers:
            tunnel._streams.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def open_tunnel(
    *,
    container_port: int,
    encrypted: bool,
    h2: bool,
    target_host: str,
    host: str,
    bind: str,
    tls: ssl.SSLContext,
    tls_h2: ssl.SSLContext,
) -> Tunnel:
    """Start the proxies of one exposed port (TLS always, plain TCP for unencrypted ports)."""
    tunnel = Tunnel(container_port=container_port, encrypted=encrypted, h2=h2, host=host)
    target = (target_host, container_port)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _proxy(tunnel, target, reader, writer)

    tls_server = await asyncio.start_server(handle, bind, 0, ssl=tls_h2 if h2 else tls)
    tunnel._servers.append(tls_server)
    tunnel.tls_port = tls_server.sockets[0].getsockname()[1]
    if not encrypted:
        tcp_server = await asyncio.start_server(handle, bind, 0)
        tunnel._servers.append(tcp_server)
        tunnel.tcp_port = tcp_server.sockets[0].getsockname()[1]
    return tunnel
