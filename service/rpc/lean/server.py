"""The lean gRPC front's listening sockets, its connections' timers, and stopping with a grace period.

`LeanServer` answers to what the composition root asks of grpc.aio's server (`add_generic_rpc_handlers`,
`add_insecure_port`, `add_secure_port`, `start`, `stop`), so either front is built and stopped the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import ssl
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any

import grpc
import grpc.aio

from mhaserve.runtime.errors import Unavailable
from mhaserve.service.connections import DEFAULT_LIMIT as DEFAULT_CONNECTION_LIMIT
from mhaserve.service.connections import (
    ConnectionLimit,
    bounded_accepts,
    create_server,
    http1_request_target,
    plain_answer,
    stop_accepting,
)
from mhaserve.service.incoming import Incoming, default_limit
from mhaserve.service.rpc.lean import frames as f
from mhaserve.service.rpc.lean.calls import Calls, Refused
from mhaserve.service.rpc.lean.connection import Connection, Stream

BACKLOG = 1024  # connections the kernel holds for us before we accept them
SWEEP_S = 1.0  # how often the connections' timers are looked at
HTTP1_TLS_ANSWER = plain_answer(  # to a plain HTTP/1.x request on the TLS port
    400,
    "this port speaks gRPC over TLS: call it with a gRPC client and TLS (the server's CA: --tls-ca); HTTP "
    "requests go to the HTTP port (--http-port), with https://",
)


class LeanServer:
    """See the module docstring. The options are grpc.aio's server options of the same meaning."""

    def __init__(
        self,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        *,
        max_message_bytes: int = 4 << 20,
        probe_methods: Iterable[str] = (),
        incoming: Incoming | None = None,
        message_timeout: float = 10.0,
        max_streams: int = 1000,
        max_glitches: int = 1000,
        handshake_timeout: float = 10.0,
        idle_s: float = 0.0,
        max_age_s: float = 0.0,
        max_age_grace_s: float = 0.0,
        reuse_port: bool = False,
        connection_limit: ConnectionLimit | None = None,
        refused: Refused | None = None,
    ) -> None:
        # `refused` counts a call refused while its request is read, before the interceptors see it (calls.py)
        self.calls = Calls(interceptors, refused)
        self.max_message_bytes = max_message_bytes
        # Methods whose requests are a few bytes (health, reflection: open without a key), held apart (connection.py)
        self.probe_methods = frozenset(probe_methods)
        # Request bytes held while they arrive, shared with the HTTP server (incoming.py); a call whose message
        # is still incomplete `message_timeout` seconds after it began to arrive is failed (connection.py).
        self.incoming = incoming or Incoming(default_limit(max_message_bytes))
        self.message_timeout = message_timeout
        self.max_streams = max_streams
        # PINGs, SETTINGS and calls reset while they run, a connection and a second, before its GOAWAY
        # (connection.py). grpc's clients send a few PINGs a second at most (BDP probes, keepalives).
        self.max_glitches = max_glitches
        self.handshake_timeout = handshake_timeout
        self.idle_s = idle_s
        self.max_age_s = max_age_s
        self.max_age_grace_s = max_age_grace_s
        self.reuse_port = reuse_port
        self.connections: set[Connection] = set()
        # Open connections against --max-connections, shared with the HTTP server (service/connections.py)
        self.connection_limit = connection_limit or ConnectionLimit(DEFAULT_CONNECTION_LIMIT)
        # Set once stop() begins: a connection accepted as the listener closed (asyncio makes its transport a
        # turn or more after the accept) is sent away at once, rather than left unserved until its client's
        # deadline.
        self.stopping = False
        self._sockets: list[tuple[socket.socket, ssl.SSLContext | None]] = []
        self._servers: list[asyncio.Server] = []
        self._sweeper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "the server has not started"
        return self._loop

    def serve(self, connection: Connection, stream: Stream) -> Coroutine[Any, Any, None]:
        """The call on a connection's new stream, as a coroutine for the connection to run as a task."""
        return self.calls.serve(connection, stream)

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self.calls.handlers.extend(handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._bind(address, None)

    def add_secure_port(self, address: str, context: ssl.SSLContext) -> int:
        return self._bind(address, context)

    def _bind(self, address: str, context: ssl.SSLContext | None) -> int:
        """Bind now, as grpc does, so that the port is known (and a port in use an error) before start()."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]") or None  # type: ignore[assignment]
        try:
            family, kind, proto, _, where = socket.getaddrinfo(
                host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            sock = socket.socket(family, kind, proto)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"cannot listen on {address}: {e}") from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # "[::]" takes IPv4 too, as grpc's
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind(where)
        except OSError as e:
            sock.close()
            raise RuntimeError(f"cannot listen on {address}: {e.strerror or e}") from None
        self._sockets.append((sock, context))
        return int(sock.getsockname()[1])

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for sock, context in self._sockets:
            self._servers.append(
                await create_server(
                    self._loop,
                    lambda: Connection(self),
                    sock=sock,
                    context=context,
                    handshake_timeout=self.handshake_timeout,
                    limit=self.connection_limit,
                    protocol="grpc",
                    answer_refused=False,  # closed unread, as a plain one (connection.py)
                    plaintext=self._plaintext,
                )
            )
            bounded_accepts(sock, BACKLOG)
        self._sweeper = self._loop.create_task(self._sweep(), name="lean-grpc-connections")

    def _plaintext(self, connection: asyncio.BaseProtocol, transport: asyncio.Transport, data: bytes) -> bool:
        """A client speaking plaintext HTTP/2 to the TLS port (connections.create_server's `plaintext`): served in
        plaintext, every call answered UNAVAILABLE saying why, where a failed handshake reads "Socket closed" to
        grpc's clients and nothing more. A plain HTTP/1.x request (curl http:// to the gRPC port) is answered
        400 saying what the port speaks, where it read "Empty reply from server". Anything else fails the
        handshake."""
        if http1_request_target(data) is not None:
            transport.write(HTTP1_TLS_ANSWER)
            transport.write_eof()  # then what else the client sends is read and dropped until it closes
            return True
        if not f.PREFACE.startswith(data[: len(f.PREFACE)]):
            return False
        assert isinstance(connection, Connection)
        connection.refusal = Unavailable(
            "this port speaks TLS, and the client connected in plaintext: connect with TLS and the server's CA "
            "(grpc.secure_channel; mhaserve's commands: --tls-ca)"
        )
        transport.set_protocol(connection)
        connection.connection_made(transport)
        connection.data_received(data)
        return True

    async def stop(self, grace: float | None) -> None:
        """Listen no more, send every connection a GOAWAY, wait up to `grace` seconds for the calls in flight,
        then cut what is left (its calls are cancelled; a connection with none is closed, not reset)."""
        self.stopping = True
        self.connection_limit.stopping = True  # the connections still accepted are sent away: none cut for them
        if self._servers:
            await stop_accepting([sock for sock, _ in self._sockets])  # the connections accepted are sent away
        for server in self._servers:
            server.close()
        self._servers.clear()
        for connection in list(self.connections):
            connection.goaway()
        if self._loop is not None:
            end = self._loop.time() + (grace or 0.0)
            # Until every connection has ended: its calls, those its client sent before it read the GOAWAY included,
            # and then its client's end (connection.py's docstring)
            while self.connections and self._loop.time() < end:  # noqa: ASYNC110
                await asyncio.sleep(0.02)  # calls end in their own tasks; polling them is simpler than signals
        for connection in list(self.connections):
            connection.cut()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await asyncio.sleep(0)  # let the cancelled calls run their endings

    async def _sweep(self) -> None:
        """GOAWAY to a connection idle for `idle_s` or older than `max_age_s` (give or take 10 %, so that a
        replica's clients do not all reconnect at once); cut one still open `max_age_grace_s` after that. Fail
        the calls whose message has been arriving for more than `message_timeout`."""
        ages: dict[Connection, float] = {}
        goaway_at: dict[Connection, float] = {}
        while True:
            await asyncio.sleep(SWEEP_S)
            now = self.loop.time()
            for connection in list(self.connections):
                connection.expire_arrivals(now - self.message_timeout)
                if connection.going_away:
                    since = goaway_at.setdefault(connection, now)
                    if self.max_age_grace_s and now - since > self.max_age_grace_s:
                        connection.abort()
                    continue
                idle = not connection.streams and now - connection.last_call > self.idle_s
                if self.max_age_s:
                    age = ages.setdefault(connection, self.max_age_s * random.uniform(1.0, 1.1))
                    if now - connection.opened > age:
                        connection.goaway()
                        continue
                if self.idle_s and idle:
                    connection.goaway()
            for gone in [c for c in ages if c not in self.connections]:
                del ages[gone]
            for gone in [c for c in goaway_at if c not in self.connections]:
                del goaway_at[gone]
