"""encoder.v1 `Encode` from a small HTTP/2 client of the bench's own: gRPC's framing over one connection,
without grpcio (`mhaserve bench --grpc-client h2`).

The bench's clients run on the server's machine, so what a request costs the load generator is taken from
the server. Its HTTP client is a small HTTP/1.1 client for that reason (transports.py), but grpc.aio's client
costs twice as much a request (0.31-0.32 ms of CPU against 0.15 at 32 clients on a 2-core EPYC, Zen 5;
docs/benchmarks.md), so gRPC's figures carried more of the load generator than HTTP's. This client does
what grpc.aio's does on the wire for a unary call and no more: one connection (or one per client, as
`own_channels` asks), a stream per call, the request's headers made once as grpc core sends them (a
connection's first call adds them to HPACK's table, each later call names them by index, one byte each), the
answer's headers decoded (the `hpack` package), flow control both ways, PINGs answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, NamedTuple

import grpc
import hpack

from mhaserve.loadtest.bench.workloads import Workload
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.service.rpc.lean import frames as f

METHOD = "/encoder.v1.EncoderService/Encode"
WINDOW = 1 << 24  # what the server may send ahead, a stream and the connection
_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class H2Error(Exception):
    """A call that did not end with status OK: `key` as the bench counts it (a gRPC status's name)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class RequestBlocks(NamedTuple):
    """A call's header block on a connection: `first` for its first call, `repeat` for every later one."""

    first: bytes
    repeat: bytes


class H2Connection(asyncio.Protocol):
    """One HTTP/2 connection carrying unary gRPC calls: `await call(blocks, message)` is the answer's message.
    Its calls all send the same `RequestBlocks`: the first adds the headers to the server's HPACK table."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.decoder = hpack.Decoder()
        self.next_id = 1
        self.calls: dict[int, tuple[asyncio.Future[bytes], bytearray]] = {}
        self.send_window = f.DEFAULT_WINDOW  # the connection's, for our DATA
        self.peer_window = f.DEFAULT_WINDOW  # a new stream's
        self.waiting: list[tuple[int, bytes]] = []  # requests held for the connection's window
        self.received = 0
        self.block: tuple[int, int, bytearray] | None = None
        self.indexed = False  # the request's headers are in the server's table: sent by index
        self.lost: Exception | None = None

    @classmethod
    async def open(cls, host: str, port: int) -> H2Connection:
        _, connection = await asyncio.get_running_loop().create_connection(cls, host, port)
        return connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(
            f.PREFACE
            + f.settings((f.ENABLE_PUSH, 0), (f.INITIAL_WINDOW_SIZE, WINDOW))
            + f.window_update(0, WINDOW - f.DEFAULT_WINDOW)
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionResetError("the server closed the connection")
        for future, _ in self.calls.values():
            if not future.done():
                future.set_exception(H2Error("UNAVAILABLE"))
        self.calls.clear()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def call(self, blocks: RequestBlocks, message: bytes) -> asyncio.Future[bytes]:
        """Send one call (its header block, its request message); the future is the answer's message."""
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        if self.lost is not None or self.transport is None:
            future.set_exception(H2Error("UNAVAILABLE"))
            return future
        stream, self.next_id = self.next_id, self.next_id + 2
        self.calls[stream] = (future, bytearray())
        body = b"\x00" + len(message).to_bytes(4, "big") + message
        # Blocks reach the server in the order written, so a later call's indexes follow the first's additions.
        block, self.indexed = (blocks.repeat if self.indexed else blocks.first), True
        head = f.frame(f.HEADERS, f.END_HEADERS, stream, block)
        if self.waiting or len(body) > min(self.send_window, self.peer_window):
            self.transport.write(head)
            self.waiting.append((stream, body))
        else:
            self.send_window -= len(body)
            self.transport.write(head + f.frame(f.DATA, f.END_STREAM, stream, body))
        return future

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        out: list[bytes] = []
        for kind, flags, stream, payload in f.whole_frames(buf):
            self._frame(kind, flags, stream, payload, out)
        if self.received >= WINDOW // 2:
            out.append(f.window_update(0, self.received))
            self.received = 0
        if out and self.transport is not None:
            self.transport.write(b"".join(out))

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes, out: list[bytes]) -> None:
        if kind == f.DATA:
            self.received += len(payload)
            entry = self.calls.get(stream)
            if entry is not None:
                entry[1].extend(payload[1 : len(payload) - payload[0]] if flags & f.PADDED else payload)
        elif kind in (f.HEADERS, f.CONTINUATION):
            if kind == f.HEADERS:
                if flags & f.PADDED:
                    payload = payload[1 : len(payload) - payload[0]]
                if flags & f.PRIORITY_FLAG:
                    payload = payload[5:]
                self.block = (stream, flags, bytearray(payload))
            elif self.block is not None:
                self.block[2].extend(payload)
            if flags & f.END_HEADERS and self.block is not None:
                stream, first, block = self.block
                self.block = None
                fields = dict(self.decoder.decode(bytes(block)))  # decoded always: the table must follow
                if first & f.END_STREAM:
                    self._end(stream, fields)
        elif kind == f.SETTINGS:
            if not flags & f.ACK:
                for i in range(0, len(payload), 6):
                    if int.from_bytes(payload[i : i + 2], "big") == f.INITIAL_WINDOW_SIZE:
                        self.peer_window = int.from_bytes(payload[i + 2 : i + 6], "big")
                out.append(f.frame(f.SETTINGS, f.ACK, 0))
                self._send_waiting(out)
        elif kind == f.PING:
            if not flags & f.ACK:
                out.append(f.frame(f.PING, f.ACK, 0, payload))
        elif kind == f.WINDOW_UPDATE:
            if stream == 0:
                self.send_window += int.from_bytes(payload, "big") & 0x7FFFFFFF
                self._send_waiting(out)
        elif kind == f.RST_STREAM:
            entry = self.calls.pop(stream, None)
            if entry is not None and not entry[0].done():
                entry[0].set_exception(H2Error("CANCELLED"))
        elif kind == f.GOAWAY:
            last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            self.lost = ConnectionResetError("the server sent a GOAWAY")
            for gone in [s for s in self.calls if s > last]:  # never started there: as grpc, UNAVAILABLE
                future, _ = self.calls.pop(gone)
                if not future.done():
                    future.set_exception(H2Error("UNAVAILABLE"))

    def _end(self, stream: int, fields: dict[Any, Any]) -> None:
        entry = self.calls.pop(stream, None)
        if entry is None or entry[0].done():
            return
        future, data = entry
        status = int(fields.get("grpc-status", "2"))  # no status: UNKNOWN, as grpc reads it
        if status != 0:
            future.set_exception(H2Error(_STATUS_NAMES.get(status, str(status))))
        elif len(data) < 5 or len(data) != 5 + int.from_bytes(data[1:5], "big"):
            future.set_exception(H2Error("INTERNAL"))
        else:
            future.set_result(bytes(data[5:]))

    def _send_waiting(self, out: list[bytes]) -> None:
        while self.waiting and len(self.waiting[0][1]) <= min(self.send_window, self.peer_window):
            stream, body = self.waiting.pop(0)
            self.send_window -= len(body)
            out.append(f.frame(f.DATA, f.END_STREAM, stream, body))


def request_blocks(authority: str, timeout_s: float) -> RequestBlocks:
    """A call's header blocks, as grpcio's client sends them: POST, the method, gRPC's content type, trailers
    asked for, the deadline. As grpc core does, the first call on a connection sends each field as a literal
    that the server adds to its HPACK table, and later calls send its index there, one byte a field: a server
    decodes such a block far faster than literals (service/rpc/lean/frames.py's `indexed_fields`), so a block
    of literals every call would weigh on the server's side as no grpc client does. Made by `hpack`'s encoder,
    whose table follows the server's as it adds them, without Huffman coding (the client's CPU is the server's
    here; grpc core codes what shortens)."""
    fields = (
        (":method", "POST"),
        (":scheme", "http"),
        (":path", METHOD),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("grpc-timeout", f"{int(timeout_s)}S"),
    )
    encoder = hpack.Encoder()
    return RequestBlocks(encoder.encode(fields, huffman=False), encoder.encode(fields, huffman=False))


class GrpcH2Transport:
    """encoder.v1 `Encode` over H2Connection: every client on one connection, or each on its own with
    `own_channels` (as GrpcTransport)."""

    def __init__(
        self,
        address: str,
        workload: Workload,
        requests: list[pb.EncodeRequest],
        timeout_s: float,
        failed: Callable[[str], Exception],
        *,
        own_channels: bool = False,
    ) -> None:
        self.host, _, port = address.rpartition(":")
        self.port = int(port)
        self.messages = [r.SerializeToString() for r in requests]
        self.blocks = request_blocks(address, timeout_s)
        self.failed = failed
        self.own_channels = own_channels
        self.connections: list[H2Connection] = []

    async def __aenter__(self) -> GrpcH2Transport:
        if not self.own_channels:
            self.connections.append(await H2Connection.open(self.host, self.port))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for connection in self.connections:
            connection.close()

    def client(self) -> Callable[[int], Any]:
        shared = None if self.own_channels else self.connections[0]
        connection: H2Connection | None = shared

        async def send(i: int) -> int:
            nonlocal connection
            if connection is None or connection.lost is not None:  # its own, or again after a GOAWAY
                connection = await H2Connection.open(self.host, self.port)
                self.connections.append(connection)
            try:
                answer = await connection.call(self.blocks, self.messages[i])
            except H2Error as e:
                raise self.failed(e.key) from None
            return int(pb.EncodeResponse.FromString(answer).usage.input_tokens)

        return send
