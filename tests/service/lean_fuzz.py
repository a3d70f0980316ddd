"""A coverage-guided fuzzer's harness for the lean gRPC front's connection (service/rpc/lean/connection.py).

`one_input(data)` turns bytes into what a client could send (frames of every type, calls whose headers an
HPACK encoder of the client's wrote, gRPC messages, some of them compressed, cut into reads at random
places), feeds it to a `Connection` on a transport in memory, lets its calls run between reads, then drops
the connection, and holds the front to what it must do whatever it was sent: nothing raised out of the
protocol's callbacks or left to the event loop's handler of unhandled errors; what it wrote is whole HTTP/2
frames, within the client's windows and largest frame, whose header blocks decode in order with one HPACK
decoder, none on a stream after its end; every call's handler has ended, the connection is forgotten and none
of its request bytes is still counted (service/incoming.py) once it is gone; and (`memory`) it held no more than
PEAK_BYTES at once. The count's limit is small (INCOMING_BYTES), so that clients meet it, and before the client
goes every call whose message is still arriving is failed as too slow (as the server's sweep does after
--http-header-timeout). Whatever breaks that raises
AssertionError (or the error itself).

Run by hand with atheris (from PyPI; not in the suite's dependencies), from the repository's root
(`--memory`: with the memory check, a third as fast):

    .venv/bin/pip install atheris
    .venv/bin/python -m tests.service.lean_fuzz -max_total_time=600 -max_len=4096 -len_control=0 /tmp/lean-corpus

tests/service/test_lean_fuzz.py runs, in the suite, inputs from a seeded random source and a corpus a
coverage-guided run left (lean_fuzz_corpus.bin; `python -m tests.service.lean_fuzz --pack DIR` writes one
from a fuzzer's corpus directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import sys
import tracemalloc
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import hpack

from mhaserve.service.incoming import Incoming
from mhaserve.service.rpc.lean import frames as f
from mhaserve.service.rpc.lean.connection import Connection
from mhaserve.service.rpc.lean.server import LeanServer

SERVICE = "fuzz.Lean"
# The most one client may make the front hold at once (a handful of messages at the harness's 64 KiB limit,
# and answers of 100 KiB): a request that inflates, or a buffer that grows with what a client sends, beyond
# the limits shows here.
PEAK_BYTES = 4 << 20
INCOMING_BYTES = 3 << 10  # of the 4 KiB an input is at most: several calls' messages reach it
METHODS = ("echo", "fail", "crash", "count", "total", "chat", "big", "nope")


class Source:
    """Choices drawn from the input's bytes, as atheris's FuzzedDataProvider draws them; past the end, zeros
    (the smallest choice), so that every input is a whole case."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def left(self) -> int:
        return len(self.data) - self.at

    def byte(self) -> int:
        if self.at >= len(self.data):
            return 0
        self.at += 1
        return self.data[self.at - 1]

    def below(self, n: int) -> int:
        """An integer in [0, n), n at most 2**16."""
        return ((self.byte() << 8) | self.byte()) % n if n > 256 else self.byte() % n

    def bytes(self, at_most: int) -> bytes:
        n = min(self.below(at_most + 1), self.left())
        self.at += n
        return self.data[self.at - n : self.at]

    def pick(self, options: tuple[Any, ...] | list[Any]) -> Any:
        return options[self.below(len(options))]


# ---- the service the connection serves ---------------------------------------------------------------------


async def _echo(request: bytes, context: Any) -> bytes:
    metadata = dict(context.invocation_metadata())
    context.set_trailing_metadata((("echo-bin", metadata.get("tag-bin", b"")),))
    return request


async def _fail(request: bytes, context: Any) -> bytes:
    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "ça ne va pas")
    return b""


async def _crash(request: bytes, context: Any) -> bytes:
    raise RuntimeError("a handler's own bug")


async def _count(request: bytes, context: Any) -> AsyncIterator[bytes]:
    for i in range(request[0] % 8 if request else 2):
        yield bytes([i]) * 100
        await asyncio.sleep(0)


async def _total(requests: AsyncIterator[bytes], context: Any) -> bytes:
    n = 0
    async for message in requests:
        n += len(message)
    return str(n).encode()


async def _chat(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for message in requests:
        yield message[::-1]


async def _big(request: bytes, context: Any) -> bytes:
    return bytes(range(256)) * 400  # 100 KiB: past the default window, and frames of the peer's size


def handlers() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "echo": grpc.unary_unary_rpc_method_handler(_echo),
            "fail": grpc.unary_unary_rpc_method_handler(_fail),
            "crash": grpc.unary_unary_rpc_method_handler(_crash),
            "big": grpc.unary_unary_rpc_method_handler(_big),
            "count": grpc.unary_stream_rpc_method_handler(_count),
            "total": grpc.stream_unary_rpc_method_handler(_total),
            "chat": grpc.stream_stream_rpc_method_handler(_chat),
        },
    )


# ---- what a client sends -----------------------------------------------------------------------------------

_KINDS = (f.DATA, f.HEADERS, f.HEADERS, f.HEADERS, f.PRIORITY, f.RST_STREAM, f.SETTINGS, f.PUSH_PROMISE, f.PING,
          f.GOAWAY, f.WINDOW_UPDATE, f.CONTINUATION, 0xFA)  # fmt: skip
_FLAGS = (0, f.END_STREAM, f.END_HEADERS, f.END_HEADERS | f.END_STREAM, f.PADDED, f.PRIORITY_FLAG, f.ACK)
_BIG = "v" * 20_000  # past the metadata limit (16 KiB)
_BOMB = gzip.compress(bytes(16 << 20), 9)  # 16 KB inflating to 16 MiB, past the message limit (64 KiB)
_EXTRA = (
    ("grpc-timeout", "1S"),
    ("grpc-timeout", "99999999n"),
    ("grpc-timeout", "x"),
    ("grpc-encoding", "gzip"),
    ("grpc-encoding", "deflate"),
    ("grpc-encoding", "br"),
    ("tag-bin", "AAEC"),
    ("tag-bin", "not base64!"),
    ("who", "me"),
    ("te", "trailers"),
    ("content-length", "12"),
    ("connection", "close"),
    (":path", "/again"),
    ("Upper", "case"),
    ("x-big", _BIG),
)
_SETTINGS = (f.HEADER_TABLE_SIZE, f.ENABLE_PUSH, f.MAX_CONCURRENT_STREAMS, f.INITIAL_WINDOW_SIZE, f.MAX_FRAME_SIZE,
             f.MAX_HEADER_LIST_SIZE, 0, 9)  # fmt: skip
_VALUES = (0, 1, 100, 16_383, 16_384, 65_535, 1 << 20, (1 << 24) - 1, 1 << 24, f.MAX_WINDOW, 1 << 31, (1 << 32) - 1)


def _call_block(src: Source, encoder: hpack.Encoder) -> tuple[bytes, str]:
    """A call's header block, written by the client's HPACK encoder, and the grpc-encoding it names."""
    fields = [
        (":method", "POST" if src.below(8) else "GET"),
        (":scheme", "http"),
        (":path", f"/{SERVICE}/{src.pick(METHODS)}" if src.below(16) else src.bytes(20).decode("latin-1")),
        (":authority", "localhost"),
        ("content-type", "application/grpc" if src.below(8) else src.pick(("application/grpc+proto", "text/plain"))),
        ("te", "trailers"),
    ]
    if src.below(12) == 0:
        del fields[src.below(len(fields))]
    for _ in range(src.below(6) // 3):
        fields.append(src.pick(_EXTRA))
    huffman = bool(src.below(2)) and ("x-big", _BIG) not in fields  # hpack Huffman-codes 20 KB in 3 ms
    block = bytes(encoder.encode(fields, huffman=huffman))
    encoding = dict(fields).get("grpc-encoding", "identity")
    return (block[: src.below(len(block) + 1)] if src.below(16) == 0 else block), encoding


def _message(src: Source, encoding: str) -> bytes:
    body = src.bytes(40)
    compressed = 0
    if src.below(4) == 0:
        compressed = 1
        if encoding == "gzip":
            body = src.pick((gzip.compress(body), gzip.compress(body), gzip.compress(body * 1000), _BOMB))
        elif encoding == "deflate":
            body = zlib.compress(body)
    length = len(body) if src.below(8) else src.pick((len(body) + 1, 0, 1 << 24))
    return bytes([compressed if src.below(16) else 2]) + length.to_bytes(4, "big") + body


def _payload(src: Source, kind: int, encoder: hpack.Encoder) -> bytes:
    if kind in (f.HEADERS, f.CONTINUATION, f.PUSH_PROMISE):
        return _call_block(src, encoder)[0] if src.below(8) else src.bytes(30)  # on a stream as the input says
    if kind == f.DATA:
        return _message(src, src.pick(("identity", "gzip", "deflate"))) if src.below(8) else src.bytes(30)
    if kind == f.SETTINGS:
        pairs = [(src.pick(_SETTINGS), src.pick(_VALUES)) for _ in range(src.below(4))]
        raw = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in pairs)
        return raw + src.pick((b"", b"", b"\x00"))
    if kind == f.WINDOW_UPDATE:
        return src.pick((1, 100, 1 << 16, f.MAX_WINDOW, 0, 1 << 31)).to_bytes(4, "big")[: src.pick((4, 4, 4, 3))]
    if kind in (f.PING, f.GOAWAY):
        return bytes(8) if src.below(4) else src.bytes(12)
    if kind in (f.RST_STREAM, f.PRIORITY):  # an error code, or a dependency (perhaps on itself) and a weight
        fields = src.below(16).to_bytes(4, "big") + (bytes(1) if kind == f.PRIORITY else b"")
        return fields if src.below(4) else src.bytes(8)
    return src.bytes(30)


def client_bytes(src: Source) -> bytes:
    """What a client sends after the preface: its SETTINGS, then frames and calls as `src` chooses."""
    encoder = hpack.Encoder()
    out = [f.PREFACE, f.settings()]
    stream = -1
    while src.left() > 0 and len(out) < 64:
        if src.below(4):  # a call: HEADERS on the next stream, then its messages
            stream += 2
            block, encoding = _call_block(src, encoder)
            ending = f.END_STREAM if src.below(5) == 0 else 0
            if src.below(6) == 0 and len(block) > 1:  # its block split across a CONTINUATION
                cut = src.below(len(block))
                out.append(f.frame(f.HEADERS, ending, stream, block[:cut]))
                out.append(f.frame(f.CONTINUATION, f.END_HEADERS, stream, block[cut:]))
            else:
                out.append(f.frame(f.HEADERS, f.END_HEADERS | ending, stream, block))
            if not ending:
                for i in range(n := src.below(4)):
                    flags = f.END_STREAM if i == n - 1 and src.below(4) else 0
                    out.append(f.frame(f.DATA, flags, stream, _message(src, encoding)))
            continue
        kind = src.pick(_KINDS)
        flags = src.pick(_FLAGS) if src.below(6) else src.byte()
        if kind == f.HEADERS and src.below(4):
            flags |= f.END_HEADERS
        target = src.pick((0, max(stream, 1), max(stream, 1), stream + 2, stream + 1, 0x7FFFFFFF))
        out.append(f.frame(kind, flags, target, _payload(src, kind, encoder)))
    return b"".join(out)


# ---- the connection, in memory -----------------------------------------------------------------------------


class Transport(asyncio.Transport):
    """What the connection writes, kept; closing it tells the connection it is lost, as asyncio does."""

    def __init__(self, connection: Connection, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.connection = connection
        self.loop = loop
        self.written = bytearray()
        self.closing = False
        self.eof = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.eof, "a write after our end of the connection"
        if not self.closing:
            self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.loop.call_soon(self.connection.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 50000) if name == "peername" else default

    def get_write_buffer_size(self) -> int:
        return 0


class Harness:
    """One event loop and one server for every input (as a fuzzer runs millions of them)."""

    def __init__(self, memory: bool = False) -> None:
        """`memory`: trace Python's allocations and hold each input to PEAK_BYTES (slower: the suite's runs)."""
        self.memory = memory
        if memory:
            tracemalloc.start()
        self.loop = asyncio.new_event_loop()
        self.errors: list[str] = []
        self.loop.set_exception_handler(lambda loop, context: self.errors.append(repr(context)))
        self.server = LeanServer(
            max_message_bytes=1 << 16, incoming=Incoming(INCOMING_BYTES), max_streams=8, max_glitches=50
        )
        self.server.add_generic_rpc_handlers([handlers()])
        self.loop.run_until_complete(self.server.start())

    def turns(self, n: int) -> None:
        for _ in range(n):
            self.loop.run_until_complete(asyncio.sleep(0))

    def run(self, data: bytes) -> bytes:
        """What the connection wrote for the client `data` makes (check() has passed on it)."""
        src = Source(data)
        sent = client_bytes(src)
        if self.memory:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
        connection = Connection(self.server)
        transport = Transport(connection, self.loop)
        self.errors.clear()
        connection.connection_made(transport)
        at = 0
        while at < len(sent):  # in reads cut where the input says, the calls running between them
            n = 1 + src.below(4096) if src.left() else len(sent)
            if transport.reading and not transport.closing:
                connection.data_received(sent[at : at + n])
            at += n
            self.turns(src.below(4))
        self.turns(8)
        connection.expire_arrivals(self.loop.time() + 1)  # what it has not finished sending has taken too long
        self.turns(8)
        transport.close()  # the client goes: every call still running is cancelled
        for _ in range(200):
            self.turns(1)
            if not connection.streams and connection.running == 0:
                break
        check(connection, transport, self.server, self.errors, sent)
        if self.memory:
            peak = tracemalloc.get_traced_memory()[1] - before
            assert peak < PEAK_BYTES, f"{peak} bytes at once for a client that sent {len(sent)}"
        return bytes(transport.written)

    def close(self) -> None:
        self.loop.run_until_complete(self.server.stop(0))
        self.loop.close()
        if self.memory:
            tracemalloc.stop()


def frames_of(written: bytes) -> Iterator[tuple[int, int, int, bytes]]:
    buf = bytearray(written)
    yield from f.whole_frames(buf)
    assert not buf, f"{len(buf)} bytes written that are not a whole frame"


@dataclass
class Granted:
    """The most the client let the server send, from every frame it sent (frames it never got to send
    included, so these are upper bounds): the connection's window, a stream's initial window and what each
    stream's WINDOW_UPDATEs added, and the largest frame."""

    connection: int = f.DEFAULT_WINDOW
    initial: int = f.DEFAULT_WINDOW
    streams: Counter[int] = field(default_factory=Counter)
    max_frame: int = f.DEFAULT_MAX_FRAME


def granted(sent: bytes) -> Granted:
    g = Granted()
    buf = bytearray(sent[len(f.PREFACE) :])
    with contextlib.suppress(f.FrameTooLarge):
        for kind, flags, stream, payload in f.whole_frames(buf):
            if kind == f.SETTINGS and not flags & f.ACK:
                for i in range(0, len(payload) - 5, 6):
                    key = int.from_bytes(payload[i : i + 2], "big")
                    value = int.from_bytes(payload[i + 2 : i + 6], "big")
                    if key == f.INITIAL_WINDOW_SIZE:
                        g.initial = max(g.initial, value)
                    elif key == f.MAX_FRAME_SIZE:
                        g.max_frame = max(g.max_frame, value)
            elif kind == f.WINDOW_UPDATE and len(payload) == 4:
                increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
                if stream == 0:
                    g.connection += increment
                else:
                    g.streams[stream] += increment
    return g


def check(connection: Connection, transport: Transport, server: LeanServer, errors: list[str], sent: bytes) -> None:
    assert not errors, errors
    assert connection.running == 0, f"{connection.running} handlers still running after the connection went"
    assert not connection.streams, connection.streams
    assert connection not in server.connections
    assert server.incoming.held == 0, f"{server.incoming.held} request bytes still counted after the client went"
    decoder = hpack.Decoder()
    decoder.max_header_list_size = 1 << 20
    g = granted(sent)
    data: Counter[int] = Counter()
    ended: set[int] = set()
    for kind, flags, stream, payload in frames_of(bytes(transport.written)):
        assert kind in (f.DATA, f.HEADERS, f.RST_STREAM, f.SETTINGS, f.PING, f.GOAWAY, f.WINDOW_UPDATE), kind
        assert len(payload) <= (g.max_frame if kind == f.DATA else f.DEFAULT_MAX_FRAME), (kind, len(payload))
        if kind in (f.DATA, f.HEADERS):
            assert stream % 2 == 1 and stream not in ended, (f.NAMES[kind], stream, "after the stream ended")
            if flags & f.END_STREAM:
                ended.add(stream)
        if kind == f.HEADERS:
            decoder.decode(payload)
        elif kind == f.GOAWAY:  # a fault of ours while reading, which the connection turns into its end
            assert int.from_bytes(payload[4:8], "big") != f.INTERNAL_ERROR, ("a fault of ours", payload[8:])
        elif kind == f.DATA:
            data[stream] += len(payload)
            assert data[stream] <= g.initial + g.streams[stream], ("past the stream's window", stream, g)
            assert data.total() <= g.connection, ("past the connection's window", g)


_HARNESS: Harness | None = None
_MEMORY = "--memory" in sys.argv  # a fuzzer's run holding each input to PEAK_BYTES too (a third as fast)


def one_input(data: bytes) -> None:
    global _HARNESS
    if _HARNESS is None:
        _HARNESS = Harness(memory=_MEMORY)
    _HARNESS.run(data)


CORPUS = Path(__file__).parent / "lean_fuzz_corpus.bin"


def pack(directory: Path, into: Path = CORPUS) -> int:
    """A fuzzer's corpus directory as one file: each input as its length (4 bytes) and its bytes."""
    inputs = sorted(p.read_bytes() for p in directory.iterdir() if p.is_file())
    into.write_bytes(b"".join(len(d).to_bytes(4, "big") + d for d in inputs))
    return len(inputs)


def unpack(path: Path = CORPUS) -> list[bytes]:
    raw, inputs, at = path.read_bytes(), [], 0
    while at < len(raw):
        n = int.from_bytes(raw[at : at + 4], "big")
        inputs.append(raw[at + 4 : at + 4 + n])
        at += 4 + n
    return inputs


def main() -> None:
    if sys.argv[1:2] == ["--pack"]:
        print(f"{pack(Path(sys.argv[2]))} inputs written to {CORPUS}")
        return
    import logging

    import atheris  # type: ignore[import-not-found, unused-ignore]  # not in the suite's dependencies

    logging.disable(logging.CRITICAL)  # the front's log lines for each broken input
    atheris.instrument_all()
    atheris.Setup([a for a in sys.argv if a != "--memory"], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
