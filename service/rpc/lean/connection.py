"""One HTTP/2 connection of the lean gRPC front: frames in, streams, flow control both ways, frames out.

Everything runs on the event loop's thread. `data_received` parses every whole frame it was given and
answers the connection's own frames (SETTINGS, PING, WINDOW_UPDATE) in one write; a new stream's call
is started as a task (calls.py), which reads its messages and writes its answer through the methods
below. A unary answer that fits the peer's windows goes out in one write: headers, message, trailers.

Flow control: the peer's windows bound what we send (a stream whose DATA does not fit waits in
`pending` for a WINDOW_UPDATE); ours are credited back as messages are taken by their call, so a stream
holds at most one message beyond what its call has read, and the connection's window stays wide open
(the stream limit bounds the streams).

Abusive peers: what a client can make us do without a call counting against the stream limit is bounded. Calls
count until their handler has ended, not until the client resets them (a reset handler still unwinds), so resetting
streams as fast as they open ("rapid reset") does not run more handlers than the limit; the frames that cost us
work without a call (PINGs and SETTINGS to acknowledge, streams reset while their call runs, streams refused at the
limit, empty CONTINUATION frames and empty DATA frames that do not end their stream) may come at most
`max_glitches` times within any second, past which the connection ends with a GOAWAY ENHANCE_YOUR_CALM; and while
the peer does not read what we write (the transport's buffer over its high-water mark) we stop reading from it, so
acknowledgements cannot pile up in memory. What calls hold of their requests before their handlers take it (a
message still arriving, whole messages not yet read) counts against the process's --max-incoming-bytes
(service/incoming.py), shared with HTTP bodies: a call whose next bytes would pass it fails RESOURCE_EXHAUSTED, and
what it held is let go; and a message still incomplete --http-header-timeout after its first byte fails its call
(`expire_arrivals`, from the server's sweep), its clock standing while the call has an earlier message to read or
we do not read.

Our preface (SETTINGS and the connection's window) goes out with our first frames once the client's has come,
as RFC 9113 3.4 allows, not at accept: an HTTP/1.x request in its place (curl http:// to the gRPC port) is
answered 400 in HTTP/1.1 saying what the port speaks, where it read binary frames ("Received HTTP/0.9").

Frames HTTP/2 forbids are answered as RFC 9113 asks: a connection error (GOAWAY) for a frame on the wrong
stream, of the wrong length, or on a stream never opened; a stream error (RST_STREAM, no call or the call
abandoned) for a malformed request or trailers (frames.malformed), DATA or HEADERS after a stream's end, a
stream's window overflowed. What a client sent before it read our reset of a stream is ignored: the last
ENDED_MEMORY streams to end are remembered with whether we reset them. h2spec's cases: docs/grpc-fronts.md.

A call to a method that takes one request message (unary, server-streaming) runs its handler as soon as that message
is whole, without waiting for the client to end its side: most clients end it in the message's own frame, but one
may end it in a frame of its own, later, and its answer would wait for that frame. Request bytes past that message
begin a second one, what gRPC calls a cardinality violation, and the call fails UNIMPLEMENTED, the code gRPC's table
of status codes (doc/statuscodes.md) gives it and grpc-js answers: before its handler runs if the bytes came with
the message, else as they come, its handler cancelled (`_second_message`). grpc-java, grpc-js and grpc-go (its unary
methods since August 2026) run the handler only at the client's end, and so refuse every such call (grpc-java and
grpc-go with INTERNAL); here a second message that comes after our answer finds the call answered from the first, as
grpc core, under grpc.aio, answers every such call. Close enough: a client that sends its messages together (what a
broken client does) always reads the refusal, and a well-behaved one never waits for the check. A client that ends
its side with no message at all breaks the same rule the other way, and its call fails UNIMPLEMENTED too (calls.py,
`NO_MESSAGE`), as grpc-js's does (grpc-java and grpc-go: INTERNAL), where grpc core, under grpc.aio, leaves it
unanswered until its deadline. A method that takes a stream of request messages (client-streaming, bidi) takes an
empty one.

Keepalive PINGs are held to grpc core's policy, so that a client configured for one front behaves the same on
the other: since we last sent a call's headers or data, a PING sooner than 5 minutes after the last (2 hours
while no call is open) is a strike, and the third strike ends the connection with a GOAWAY ENHANCE_YOUR_CALM
whose debug data, "too_many_pings", tells grpc's clients to ping half as often.

A connection past the process's --max-connections (service/connections.py, counted with HTTP's) takes the place of
the oldest silent one of either front (here: one that has opened no call, whatever else it sent), which is cut
unanswered. With none silent, the new one is closed at once, unread and unanswered: grpc's clients then
report UNAVAILABLE and wait their reconnect backoff, where a GOAWAY on a connection that has carried no stream had
grpcio connect again at once, hundreds of times a second until its call's deadline.

A GOAWAY of ours (a drain, an idle or aged connection) goes in two steps, as RFC 9113 6.8 advises: first one
that refuses no stream (the last stream 2^31 - 1) and a PING; once the PING's acknowledgement comes back, the
client has read the GOAWAY and has no call still on its way, and the final GOAWAY names the last stream we
took. A single GOAWAY refused the calls a client had sent before it read it: grpc core's clients send those
again by themselves, but a proxy that has forwarded a request's body cannot (nginx's grpc_pass answered 502).
Then, with no call left, the connection ends without a reset: we send our end (a FIN), and read and drop what
the client still sends until it closes its end or LINGER_S pass. Closing the socket outright resets the
connection if anything the client sent is unread or still on its way (a WINDOW_UPDATE, the PING's
acknowledgement), and a reset can cost the client the last answer it had not yet read: HAProxy 2.6 cut a
response's trailers so (a call read UNKNOWN "Stream removed"). A connection error ends the same way once its
GOAWAY is written (its calls cancelled, ERROR_LINGER_S for the client's end).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Coroutine, Iterable
from typing import Any, Protocol, cast

import hpack

from mhaserve.runtime.errors import InvalidArgument, RequestTimeout, ServiceError, TooLarge, Unimplemented
from mhaserve.service.connections import (
    MAX_REQUEST_LINE,
    ConnectionLimit,
    http1_request_target,
    plain_answer,
    unsent,
)
from mhaserve.service.context import Throttle
from mhaserve.service.errors import to_status
from mhaserve.service.incoming import Incoming
from mhaserve.service.inflate import KINDS, inflate
from mhaserve.service.rpc.lean import frames as f

log = logging.getLogger(__name__)
# A line for each connection that is not gRPC (curl http:// to this port, a scanner, a balancer's check in the wrong
# protocol) or breaks HTTP/2: a client can write them as often as it likes, and 600 buried the log. At most one a
# minute of each, saying how many were left out, as the HTTP port's (http/server.py).
BAD_CONNECTIONS = Throttle(
    (
        "answered an HTTP/1.x request on the gRPC port",
        "closing a gRPC connection from",
        "a fault of ours reading a gRPC connection's frames",
    )
)
log.addFilter(BAD_CONNECTIONS)
# hpack logs every header it decodes at debug level: API keys included, and a cost on every call.
logging.getLogger("hpack").setLevel(logging.INFO)

STREAM_WINDOW = 1 << 20  # what a stream may send ahead of its call's reads
CONNECTION_WINDOW = f.MAX_WINDOW
MAX_HEADER_LIST = 16 << 10  # grpc core's own limit on a call's metadata
# A probe's request (a health check's service name, a reflection query, ServerLive's nothing) is a few bytes, and
# probes need no key: a call to one of the front's `probe_methods` takes messages up to this size, holds at most
# one such message unread, and is not counted against the process's --max-incoming-bytes, where clients without
# a key held that budget with probes' messages they never finished (and probes were refused when it was full).
# What one holds is then of the size of its stream's own bookkeeping, which the stream limit bounds.
PROBE_BYTES = 4 << 10
# A call whose metadata is over MAX_HEADER_LIST is answered RESOURCE_EXHAUSTED, as grpc core answers, and the
# connection serves on. Its header block must still be decoded whole, to keep HPACK's table in step with the
# peer's; past this many bytes received or decoded (a block of references to one large table entry can decode to
# far more than it is), the decoder stops and the connection ends instead. Not 64 KiB, as until 2026-12-07: a
# grpcio client's 70 KB value (sent without Huffman coding) or 2,000 small entries (HPACK counts 32 bytes more
# for each) ended the connection, and every call on it, where grpc core refuses the one call.
MAX_HEADER_LIST_DECODED = 16 * MAX_HEADER_LIST
CALM_WINDOW_S = 1.0  # the window over which PINGs, SETTINGS and resets of running calls are counted
# grpc core's server defaults (grpc.http2.min_ping_interval_without_data_ms, grpc.http2.max_ping_strikes, and
# the 2 hours it allows while no call is open): see the module docstring.
PING_INTERVAL_S = 300.0
PING_INTERVAL_IDLE_S = 7200.0
MAX_PING_STRIKES = 2
# How many ended streams a connection remembers, to tell a frame still in flight on a stream we reset (ignored)
# from one on a stream the client itself ended (a stream error) or never opened (a connection error).
ENDED_MEMORY = 1024
# The PING that follows our first GOAWAY, and how long its acknowledgement is waited for before the final one.
# grpc core waits 20 s; 1 s here, since the stop waits for the connections to end: the peers that cannot resend
# a refused call (proxies) answer a PING at once, and grpc's clients resend a call refused by a GOAWAY themselves.
GOAWAY_PING = b"draining"
GOAWAY_ACK_WAIT_S = 1.0
LINGER_S = 5.0  # how long an ended connection waits for the client to close its end (the module docstring)
# The same after a connection error (_close): a second, as Go's HTTP/2 server reads after its GOAWAY; a peer that
# breaks the protocol should not hold its connection's place for long.
ERROR_LINGER_S = 1.0
# A call that takes one request message and was sent more (the module docstring): grpc-go's words, near enough.
MORE_THAN_ONE = "cardinality violation: more than one request message for a method that takes one"
# And one whose client ended its side without it (grpc-go: "received no request message").
NO_MESSAGE = "cardinality violation: no request message for a method that takes one"

HTTP1_ANSWER = plain_answer(  # to an HTTP/1.x request where the client's preface should be
    400, "this port speaks gRPC (HTTP/2): call it with a gRPC client; HTTP requests go to the HTTP port (--http-port)"
)
# Frames that belong to a stream, and frames of the connection itself (RFC 9113 6.1-6.10).
_ON_A_STREAM = frozenset({f.DATA, f.HEADERS, f.PRIORITY, f.RST_STREAM, f.CONTINUATION})
_ON_THE_CONNECTION = frozenset({f.SETTINGS, f.PING, f.GOAWAY})
_LENGTHS = {f.RST_STREAM: 4, f.PING: 8, f.WINDOW_UPDATE: 4}
# Headers that are HTTP/2's or gRPC's own, not the call's metadata.
_RESERVED = frozenset({"content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding"})


class UnknownEncoding(Unimplemented):
    """A message compressed in an algorithm we do not read: its call's trailers name those we do."""


class ConnectionError_(Exception):
    """A breach of HTTP/2 by the peer: the connection ends with a GOAWAY carrying `code`."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Stream:
    """One call's HTTP/2 stream: what came in, what waits to go out."""

    __slots__ = (
        "id",
        "method",
        "metadata",
        "deadline",
        "encoding",
        "buffer",
        "messages",
        "waiter",
        "remote_closed",
        "error",
        "error_after",
        "credit",
        "send_window",
        "pending",
        "trailer",
        "initial",
        "headers_sent",
        "closed",
        "expired",
        "reset",
        "task",
        "counted",
        "timer",
        "drained",
        "queued",
        "held",
        "arriving",
        "probe",
        "limit",
        "single",
    )

    def __init__(
        self,
        stream_id: int,
        method: str,
        metadata: tuple[tuple[str, str | bytes], ...],
        send_window: int,
        *,
        limit: int,
        probe: bool = False,
    ):
        self.id = stream_id
        self.method = method
        self.metadata = metadata
        self.deadline: float | None = None
        self.encoding = "identity"
        self.buffer = bytearray()
        self.messages: collections.deque[bytes] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.remote_closed = False
        self.error: ServiceError | None = None  # raised at the call's next read
        # A message that is not one (over the limit, not inflating): raised once the whole ones before it are read
        self.error_after: ServiceError | None = None
        self.credit = 0  # bytes received and not yet credited back to the peer
        self.send_window = send_window
        self.pending = bytearray()  # DATA payload waiting for the peer's windows
        self.trailer: bytes | None = None  # the trailers' header block, sent once `pending` is out
        self.initial = b""  # the handler's initial metadata, a header block sent with the response's headers
        self.headers_sent = False
        self.closed = False  # our side has ended it (trailers or RST_STREAM)
        self.expired = False  # its deadline passed
        self.reset = False  # the client reset it, or the connection is gone
        self.task: asyncio.Task[None] | None = None
        self.counted = False  # in the connection's `running` until its handler has ended
        self.timer: asyncio.TimerHandle | None = None
        self.drained: asyncio.Future[None] | None = None
        self.queued = 0  # bytes of the whole messages in `messages`
        self.held = 0  # bytes of `buffer` and `messages` counted in the server's Incoming (none of a probe's)
        self.arriving: float | None = None  # when the message still in `buffer` began to arrive
        self.limit = limit  # the largest request message it takes
        self.probe = probe  # a call to one of the front's `probe_methods` (PROBE_BYTES)
        self.single = False  # its call takes one message and has it: request bytes past it are a second one

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class Front(Protocol):
    """What a connection needs of its server (server.LeanServer): its limits, its loop, the set of open
    connections it keeps, whether it is stopping, and a call served on a stream."""

    max_message_bytes: int
    message_timeout: float
    incoming: Incoming
    probe_methods: frozenset[str]
    max_streams: int
    max_glitches: int
    handshake_timeout: float
    connections: set[Connection]
    connection_limit: ConnectionLimit
    stopping: bool

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def serve(self, connection: Connection, stream: Stream) -> Coroutine[Any, Any, None]: ...


class Connection(asyncio.Protocol):
    """See the module docstring. `server` starts the calls and keeps the connections' timers."""

    def __init__(self, server: Front) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.preface = False
        self.settled = False  # the client's first SETTINGS came, as its preface's end (RFC 9113 3.4)
        self.decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST_DECODED)
        self.streams: dict[int, Stream] = {}
        self.last_stream = 0
        # A header block awaiting CONTINUATION: its stream, flags, bytes, and why the stream fails (decoded first,
        # as every block must be, to keep HPACK's table in step with the peer's)
        self.block: tuple[int, int, bytearray, str | None] | None = None
        self.ended: dict[int, bool] = {}  # the last ENDED_MEMORY streams ended: True where we reset it
        self.peer_window = f.DEFAULT_WINDOW  # a new stream's send window, from the peer's SETTINGS
        self.peer_max_frame = f.DEFAULT_MAX_FRAME
        self.send_window = f.DEFAULT_WINDOW  # the connection's
        self.blocked: dict[int, Stream] = {}  # streams whose DATA waits for the connection's window, in order
        self.received = 0  # connection-level bytes not yet credited back
        self.going_away = False  # our first GOAWAY sent: the client opens no new streams
        self.refusing = False  # our final GOAWAY sent: a stream the client opens now is refused
        self.final_goaway: asyncio.TimerHandle | None = None
        self.lingering: asyncio.TimerHandle | None = None  # our end sent: what the client sends is dropped
        self.peer_going_away = False
        # While data_received reads frames, our end waits until it has written what they made (_end): a call's
        # answer queued in that read would go out after it, which drops it (the final GOAWAY naming it taken)
        self.reading = False
        self.end_after_reading: float | None = None  # the linger of that end
        self.opened = server.loop.time()
        self.last_call = self.opened
        self.handshake: asyncio.TimerHandle | None = None
        self.peer = ""
        self.running = 0  # calls whose handler has not ended, reset ones included
        # When the PINGs, SETTINGS, reset and refused calls of the last CALM_WINDOW_S came (max_glitches at most)
        self.glitches: collections.deque[float] = collections.deque()
        self.last_ping: float | None = None  # when the last PING came, since we last sent a call's frames
        self.ping_strikes = 0
        self.paused = False  # not reading, while the peer does not read what we write
        self.paused_at = 0.0  # since when, or since some of what we wrote last went out (`expire_arrivals`)
        self.written = 0  # bytes given to the transport
        self.sent = 0  # of them, those gone out by `paused_at`
        self.admitted = False  # counted against --max-connections
        self.greeting = b""  # our preface (SETTINGS), until our first write
        # Every call's answer, when set: a client that spoke plaintext to the TLS port (server.py's `plaintext`)
        self.refusal: ServiceError | None = None

    # -- the transport's callbacks --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            host = peer[0]
            self.peer = f"ipv6:[{host}]:{peer[1]}" if ":" in host else f"ipv4:{host}:{peer[1]}"
        if self.server.stopping:  # accepted in the listener's last instant: no stream of it will be served
            transport.write(f.settings() + f.goaway(0, f.NO_ERROR))
            self._end()  # no reset, which could keep its client from reading that GOAWAY
            return
        if not self.server.connection_limit.admit("grpc", self, transport):
            transport.abort()  # see the module docstring: no GOAWAY
            return
        self.admitted = True
        self.server.connections.add(self)
        # Our preface goes out with our first frames, once the client's has come (RFC 9113 3.4 lets it wait):
        # a client speaking HTTP/1.1 to this port (curl) is answered in HTTP/1.1, not with frames it cannot read.
        self.greeting = f.settings(
            (f.MAX_CONCURRENT_STREAMS, self.server.max_streams),
            (f.INITIAL_WINDOW_SIZE, STREAM_WINDOW),
            (f.MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST),
        ) + f.window_update(0, CONNECTION_WINDOW - f.DEFAULT_WINDOW)
        self.handshake = self.server.loop.call_later(self.server.handshake_timeout, self._handshake_expired)

    def pause_writing(self) -> None:
        # The peer does not read what we write: stop reading what it sends until it does.
        if self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
            self.paused_at = self.server.loop.time()
            self.sent = self._gone_out()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
            self.paused = False
            now = self.server.loop.time()
            for stream in self.streams.values():  # their messages' clocks stood while we did not read
                if stream.arriving is not None:
                    stream.arriving = now

    def connection_lost(self, exc: Exception | None) -> None:
        if self.admitted:
            self.admitted = False
            self.server.connection_limit.release(self)
        self.server.connections.discard(self)
        if self.handshake is not None:
            self.handshake.cancel()
        if self.final_goaway is not None:
            self.final_goaway.cancel()
        if self.lingering is not None:
            self.lingering.cancel()
        self._abandon_all()

    def data_received(self, data: bytes) -> None:
        self.reading = True
        try:
            self._receive(data)
        finally:
            self.reading = False
        if self.end_after_reading is not None:
            linger, self.end_after_reading = self.end_after_reading, None
            self._end(linger)

    def _receive(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing() or self.lingering is not None:
            return  # a GOAWAY has ended it: what the peer still sends is not read
        buf = self.buffer
        buf += data
        out: list[bytes] = []
        try:
            if not self.preface:
                start = bytes(buf[: len(f.PREFACE)])
                if start != f.PREFACE:
                    if f.PREFACE.startswith(start) or self._http1(bytes(buf)):
                        return  # the preface's start, or an HTTP/1.x request (answered, or its line still coming)
                    raise ConnectionError_(f.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                del buf[: len(f.PREFACE)]
                self.preface = True
                # Still silent until a call opens, but cut after those that sent nothing (connections.py): the
                # client's call waits for our SETTINGS, a round trip in which a burst could otherwise cut it.
                self.server.connection_limit.began(self)
                self._write(b"")  # our preface
            for kind, flags, stream_id, payload in f.whole_frames(buf, f.DEFAULT_MAX_FRAME):
                self._frame(kind, flags, stream_id, payload, out)
        except f.FrameTooLarge as e:
            self._close(f.FRAME_SIZE_ERROR, str(e), out)
            return
        except ConnectionError_ as e:
            self._close(e.code, str(e), out)
            return
        except Exception:
            # A fault of ours, that frames a client chose reached (an empty header name once did): that connection
            # ends with a GOAWAY, its calls cancelled, rather than with no word (asyncio's "Fatal error" reset it),
            # and the others go on. Logged with its traceback, once a minute at most.
            log.exception("a fault of ours reading a gRPC connection's frames, from %s", self.peer or "a client")
            self._close(f.INTERNAL_ERROR, "an internal error of the server's", out)
            return
        if self.received >= CONNECTION_WINDOW // 2:
            out.append(f.window_update(0, self.received))
            self.received = 0
        if out:
            self._write(b"".join(out))

    # -- frames in --

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes, out: list[bytes]) -> None:
        if not self.settled:
            if kind != f.SETTINGS or flags & f.ACK:
                raise ConnectionError_(f.PROTOCOL_ERROR, "the client's preface is not followed by its SETTINGS")
            self.settled = True
        if self.block is not None and kind != f.CONTINUATION:
            raise ConnectionError_(f.PROTOCOL_ERROR, "a header block interrupted")
        if kind in _ON_A_STREAM and stream_id == 0:
            raise ConnectionError_(f.PROTOCOL_ERROR, f"a {f.NAMES[kind]} frame on stream 0")
        if kind in _ON_THE_CONNECTION and stream_id != 0:
            raise ConnectionError_(f.PROTOCOL_ERROR, f"a {f.NAMES[kind]} frame on stream {stream_id}")
        if len(payload) != _LENGTHS.get(kind, len(payload)):
            raise ConnectionError_(f.FRAME_SIZE_ERROR, f"a {f.NAMES[kind]} frame of {len(payload)} bytes")
        if kind == f.DATA:
            self._data(flags, stream_id, payload, out)
        elif kind == f.HEADERS:
            if flags & f.PADDED:
                payload = _unpad(payload)
            why = None
            if flags & f.PRIORITY_FLAG:
                if len(payload) < 5:
                    raise ConnectionError_(f.FRAME_SIZE_ERROR, "a HEADERS frame too short for its priority")
                if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
                    why = "a stream that depends on itself"
                payload = payload[5:]
            self.block = (stream_id, flags, bytearray(payload), why)
            if flags & f.END_HEADERS:
                self._headers(out)
        elif kind == f.CONTINUATION:
            if self.block is None or self.block[0] != stream_id:
                raise ConnectionError_(f.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            if not payload:
                self._glitch()  # a frame's work for nothing: a flood of them is bounded as PINGs are
            self.block[2].extend(payload)
            if len(self.block[2]) > MAX_HEADER_LIST_DECODED:
                raise ConnectionError_(f.ENHANCE_YOUR_CALM, "a header block too large")
            if flags & f.END_HEADERS:
                self._headers(out)
        elif kind == f.SETTINGS:
            if flags & f.ACK and payload:
                raise ConnectionError_(f.FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            if not flags & f.ACK:
                self._glitch()
                self._settings(payload, out)
                if self.handshake is not None:  # the preface and its SETTINGS: the handshake is complete
                    self.handshake.cancel()
                    self.handshake = None
        elif kind == f.PING:
            if not flags & f.ACK:
                self._glitch()
                self._ping()
                out.append(f.frame(f.PING, f.ACK, 0, payload))
            elif payload == GOAWAY_PING and self.going_away and not self.refusing:
                self._refuse_new_streams()
        elif kind == f.WINDOW_UPDATE:
            self._idle(kind, stream_id)
            self._window_update(stream_id, int.from_bytes(payload, "big") & 0x7FFFFFFF, out)
        elif kind == f.RST_STREAM:
            self._idle(kind, stream_id)
            if self._drop(stream_id):  # a running call reset: work without a call
                self._remember(stream_id, reset=False)
                self._glitch()
        elif kind == f.PRIORITY:  # read only to be checked: the calls take no priorities
            if len(payload) != 5:
                self._stream_error(stream_id, f.FRAME_SIZE_ERROR, f"a PRIORITY frame of {len(payload)} bytes", out)
            elif int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
                self._stream_error(stream_id, f.PROTOCOL_ERROR, "a stream that depends on itself", out)
        elif kind == f.GOAWAY:
            self.peer_going_away = True
            if not self.streams:
                self._end()
        elif kind == f.PUSH_PROMISE:
            raise ConnectionError_(f.PROTOCOL_ERROR, "a client may not push")
        # Unknown frame types are ignored, as HTTP/2 asks.

    def _idle(self, kind: int, stream_id: int) -> None:
        """Only HEADERS and PRIORITY may come on a stream the client has not opened (RFC 9113 5.1)."""
        if stream_id > self.last_stream or (stream_id and stream_id % 2 == 0):
            raise ConnectionError_(f.PROTOCOL_ERROR, f"a {f.NAMES[kind]} frame on idle stream {stream_id}")

    def _remember(self, stream_id: int, *, reset: bool) -> None:
        """A stream ended: `reset` if we reset it, so that what the client sent before it knew is ignored."""
        ended = self.ended
        ended[stream_id] = reset
        if len(ended) > ENDED_MEMORY:
            del ended[next(iter(ended))]

    def _stream_error(self, stream_id: int, code: int, message: str, out: list[bytes]) -> None:
        """A stream error (RFC 9113 5.4.2): RST_STREAM, and the stream's call, if one runs, abandoned. On a stream
        not yet opened, which cannot be reset, a connection error. It costs us work: a glitch."""
        if stream_id > self.last_stream:
            raise ConnectionError_(code, f"{message} (stream {stream_id})")
        # Debug only: a peer may cause up to max_glitches of these a second (the connection's end is logged)
        log.debug("resetting stream %d from %s: %s", stream_id, self.peer or "a client", message)
        self._reset(stream_id, code, out)
        self._drop(stream_id)
        self._glitch()

    def _reset(self, stream_id: int, code: int, out: list[bytes]) -> None:
        """Our RST_STREAM, remembered: what the client sent on the stream before it reads it is ignored."""
        out.append(f.rst_stream(stream_id, code))
        self._remember(stream_id, reset=True)

    def _drop(self, stream_id: int) -> bool:
        """The stream over: its call, if one runs, abandoned (True where one ran)."""
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            return False
        self.blocked.pop(stream_id, None)
        self._abandon(stream)
        if (self.refusing or self.peer_going_away) and not self.streams:
            self._end()  # its last call gone, as _done ends it after the last answer
        return True

    def _data(self, flags: int, stream_id: int, payload: bytes, out: list[bytes]) -> None:
        self._idle(f.DATA, stream_id)
        # Its whole payload, padding included, is flow-controlled (RFC 9113 6.1), on the stream as on the connection
        flow = len(payload)
        self.received += flow  # whatever its stream: the connection's window counts it
        if flags & f.PADDED:
            payload = _unpad(payload)
        if not payload and not flags & f.END_STREAM:
            self._glitch()  # as an empty CONTINUATION (padding alone too); grpc's clients half-close with an empty one
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:
            if not self.ended.get(stream_id, False):  # not one we reset, whose client may not know yet
                self._stream_error(stream_id, f.STREAM_CLOSED, "DATA after the stream's end", out)
            return
        stream.credit += flow
        if stream.error is None and stream.error_after is None:
            incoming = self.server.incoming
            if stream.single and payload:
                self._second_message(stream)
            elif not stream.probe and not incoming.admits(len(payload)):
                self._fail(stream, incoming.refusal())
            else:
                stream.buffer += payload
                try:
                    self._messages(stream)
                except ServiceError as e:
                    # A message that is not one (over the limit, flagged or compressed wrongly): as grpc core's
                    # front, the call's whole messages before it are read first, and what follows it is dropped.
                    stream.error_after = e
                    stream.buffer.clear()
                    stream.wake()
                if stream.probe and len(stream.buffer) + stream.queued > stream.limit + 5:
                    unread = f"a probe's call holds at most {stream.limit + 5} bytes of its requests unread"
                    self._fail(stream, TooLarge(unread))
                else:
                    self._hold(stream)
        if flags & f.END_STREAM:
            self._remote_end(stream)
        elif stream.credit >= STREAM_WINDOW // 2 and len(stream.messages) <= 1:
            out.append(f.window_update(stream_id, stream.credit))
            stream.credit = 0

    def _remote_end(self, stream: Stream) -> None:
        """The client has ended its side, on DATA or in trailers: a message begun and not whole is refused, not
        taken for no message (a unary call's cardinality refusal) nor dropped (a client stream's)."""
        stream.remote_closed = True
        if stream.buffer and stream.error is None:
            self._fail(stream, InvalidArgument("the request's last message is incomplete"))
        stream.wake()

    def _messages(self, stream: Stream) -> None:
        """Whole gRPC messages (a 5-byte prefix, then the message) out of the stream's bytes."""
        buf, limit = stream.buffer, stream.limit
        while len(buf) >= 5:
            size = int.from_bytes(buf[1:5], "big")
            if size > limit:
                raise TooLarge(f"Received message larger than max ({size} vs. {limit})")
            if len(buf) < 5 + size:
                return
            compressed = buf[0]
            message = bytes(buf[5 : 5 + size])
            del buf[: 5 + size]
            stream.arriving = None  # what follows in `buffer` is the next message: its own clock
            if compressed:
                if compressed != 1:  # gRPC's flag is 0 or 1 (grpc-go: INTERNAL "unexpected payload format")
                    raise InvalidArgument(
                        f"a message whose compressed flag is {compressed}: 0 (not compressed) or 1 (compressed in the "
                        "call's grpc-encoding)"
                    )
                if stream.encoding == "identity":  # none named: not an algorithm to ask the client to change
                    raise InvalidArgument(
                        "a message flagged compressed, but the call names no grpc-encoding to inflate it with"
                    )
                if stream.encoding not in KINDS:
                    raise UnknownEncoding(
                        f"a message compressed with {stream.encoding!r}: this server reads gzip, deflate or "
                        "uncompressed messages"
                    )
                message = inflate(message, stream.encoding, limit, f"a {stream.encoding} message")
                if len(message) > limit:  # grpc core's words for it
                    raise TooLarge(f"Decompressed message larger than max (over {limit} bytes)")
            stream.messages.append(message)
            stream.queued += len(message)
            stream.wake()

    def _headers(self, out: list[bytes]) -> None:
        assert self.block is not None
        stream_id, flags, block, why = self.block
        self.block = None
        try:
            # Decoded to str (the decoder's default); a header that is not UTF-8 fails the block.
            raw = bytes(block)
            size = 0  # counted where it may be over the limit: indexed_fields returns None for such a list
            fields = f.indexed_fields(raw, self.decoder.header_table, MAX_HEADER_LIST)
            if fields is None:
                fields = cast(list[tuple[str, str]], self.decoder.decode(raw))
                size = f.header_list_size(fields)
        except hpack.OversizedHeaderListError:
            why = f"a header block that decodes past {MAX_HEADER_LIST_DECODED >> 10} KiB"
            raise ConnectionError_(f.ENHANCE_YOUR_CALM, why) from None
        except hpack.HPACKError as e:
            raise ConnectionError_(f.COMPRESSION_ERROR, f"a header block that does not decode: {e}") from None
        existing = self.streams.get(stream_id)
        if existing is not None:  # trailers from the client: the end of its messages
            if size > MAX_HEADER_LIST:
                self._stream_error(stream_id, f.ENHANCE_YOUR_CALM, f"trailers of {size} bytes", out)
            elif existing.remote_closed:
                why = "HEADERS after the stream's end"
                self._stream_error(stream_id, f.STREAM_CLOSED, why, out)
            elif why := why or f.malformed(fields, trailers=True) or ("" if flags & f.END_STREAM else "no END_STREAM"):
                self._stream_error(stream_id, f.PROTOCOL_ERROR, f"trailers with {why}", out)
            else:
                self._remote_end(existing)
            return
        if stream_id % 2 == 0:
            raise ConnectionError_(f.PROTOCOL_ERROR, f"a client stream with an even id ({stream_id})")
        if stream_id <= self.last_stream:
            reset = self.ended.get(stream_id)
            if reset:
                return  # trailers for a stream we reset, sent before the client knew: nothing to answer
            if reset is None:
                raise ConnectionError_(f.PROTOCOL_ERROR, f"a new stream ({stream_id}) below one opened before")
            raise ConnectionError_(f.STREAM_CLOSED, f"HEADERS on stream {stream_id} after its end")
        self.last_stream = stream_id
        if self.refusing:
            self._reset(stream_id, f.REFUSED_STREAM, out)
            return
        if why := why or f.malformed(fields):
            self._stream_error(stream_id, f.PROTOCOL_ERROR, f"a request with {why}", out)
            return
        if size > MAX_HEADER_LIST:
            why = f"received metadata of {size} bytes, over the limit of {MAX_HEADER_LIST} (16 KiB)"
            self._refuse_call(stream_id, flags, TooLarge(why), out)
            return
        if max(len(self.streams), self.running) >= self.server.max_streams:
            # Work without a call, as a reset is: opened and reset calls past the limit while their handlers
            # unwind are refused here, and must end a rapid reset as the resets would have.
            self._glitch()
            self._reset(stream_id, f.REFUSED_STREAM, out)
            return
        self._open(stream_id, flags, fields, out)

    def _refuse_call(self, stream_id: int, flags: int, error: ServiceError, out: list[bytes]) -> None:
        """Answer a call with `error`'s status before it starts (its headers alone, gRPC's Trailers-Only), as grpc
        core answers one over its limits: no handler runs, and the connection's other calls go on. Work without
        a call: a glitch."""
        code, message = to_status(error)
        self._answer_alone(stream_id, flags, f.RESPONSE_HEADERS + f.trailer_block(code.value[0], message, ()), out)
        self._glitch()

    def _answer_alone(self, stream_id: int, flags: int, block: bytes, out: list[bytes]) -> None:
        """A stream answered by one header block that ends it, before any call: the stream is over, and a
        request body that may follow is not read (RFC 9113 8.1: our RST_STREAM NO_ERROR says so)."""
        out.append(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, stream_id, block))
        if flags & f.END_STREAM:
            self._remember(stream_id, reset=False)
        else:
            self._reset(stream_id, f.NO_ERROR, out)

    def _open(self, stream_id: int, flags: int, fields: list[tuple[str, str]], out: list[bytes]) -> None:
        self.server.connection_limit.spoke(self)  # a call opened: never cut for a new connection (connections.py)
        method = path = content_type = ""
        timeout = encoding = None
        metadata: list[tuple[str, str | bytes]] = []
        bad: ServiceError | None = None  # metadata that cannot be read: the call is refused, as grpc core does
        for name, value in fields:
            if name[0] == ":":
                if name == ":path":
                    path = value
                elif name == ":method":
                    method = value
            elif name == "content-type":
                content_type = value
            elif name == "grpc-timeout":
                timeout = value
            elif name == "grpc-encoding":
                encoding = value
            elif name not in _RESERVED:
                try:
                    metadata.append((name, f.metadata_from_header(name, value)))
                except ValueError:
                    bad = InvalidArgument(f"metadata {name!r} is not base64, as a -bin key's value must be")
        if method != "POST" or not _grpc_content_type(content_type):
            # Not a gRPC call: HTTP's own refusal, as gRPC's protocol asks (415 for a content type).
            status = "405" if method != "POST" else "415"
            self._answer_alone(stream_id, flags, f.header_block(((":status", status),)), out)
            return
        seconds = None if timeout is None else f.grpc_timeout(timeout)
        if timeout is not None and seconds is None:
            bad = InvalidArgument(f"grpc-timeout {timeout!r} is not a timeout (up to 8 digits, then H, M, S, m, u, n)")
        bad = bad or self.refusal
        if bad is not None:
            self._refuse_call(stream_id, flags, bad, out)
            return
        limit, probe = self.server.max_message_bytes, path in self.server.probe_methods
        if probe:
            limit = min(limit, PROBE_BYTES)
        stream = Stream(stream_id, path, tuple(metadata), self.peer_window, limit=limit, probe=probe)
        if encoding is not None:
            stream.encoding = encoding
        loop = self.server.loop
        if seconds is not None:
            stream.deadline = loop.time() + seconds
            stream.timer = loop.call_at(stream.deadline, self._expire, stream)
        if flags & f.END_STREAM:
            stream.remote_closed = True
        self.streams[stream_id] = stream
        self.last_call = loop.time()
        self.running += 1
        stream.counted = True
        stream.task = loop.create_task(self.server.serve(self, stream))
        stream.task.add_done_callback(lambda _: self.handler_ended(stream))

    def handler_ended(self, stream: Stream) -> None:
        """The stream's handler has ended: it no longer counts against the stream limit. Called by the call
        itself once it has answered, in the same turn of the loop as its trailers were written: the task's
        done callback comes a turn later, and a client that read those trailers meanwhile may already have
        opened its next call, which was then refused past the limit the client kept (and, 1,000 of them in a
        second, ended the connection as abusive: a flood of calls on a busy host). The done callback remains
        for a task cancelled before it ran."""
        if stream.counted:
            stream.counted = False
            self.running -= 1

    def _glitch(self) -> None:
        """Count a frame that costs us work without a call; past `max_glitches` within any CALM_WINDOW_S, the end.

        A sliding count: a window that restarted every CALM_WINDOW_S let a peer that timed its burst across the
        restart have up to twice the limit within one window."""
        now = self.server.loop.time()
        glitches = self.glitches
        while glitches and now - glitches[0] >= CALM_WINDOW_S:
            glitches.popleft()
        glitches.append(now)
        if len(glitches) > self.server.max_glitches:
            raise ConnectionError_(
                f.ENHANCE_YOUR_CALM,
                f"more than {self.server.max_glitches} PINGs, SETTINGS, empty frames and reset or refused calls "
                f"in {CALM_WINDOW_S:g} s",
            )

    def _ping(self) -> None:
        """A keepalive PING, held to grpc core's policy (the module docstring)."""
        now, last = self.server.loop.time(), self.last_ping
        self.last_ping = now
        if last is None or now - last >= (PING_INTERVAL_S if self.streams else PING_INTERVAL_IDLE_S):
            return
        self.ping_strikes += 1
        if self.ping_strikes > MAX_PING_STRIKES:
            raise ConnectionError_(f.ENHANCE_YOUR_CALM, "too_many_pings")

    def _answering(self) -> None:
        """We send a call's headers or data: PINGs count afresh (a client's BDP pings follow our data)."""
        self.last_ping = None
        self.ping_strikes = 0

    def _settings(self, payload: bytes, out: list[bytes]) -> None:
        if len(payload) % 6:
            raise ConnectionError_(f.FRAME_SIZE_ERROR, "a SETTINGS frame of a length not a multiple of 6")
        window = None
        for at in range(0, len(payload), 6):
            key = int.from_bytes(payload[at : at + 2], "big")
            value = int.from_bytes(payload[at + 2 : at + 6], "big")
            if key == f.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise ConnectionError_(f.FLOW_CONTROL_ERROR, "an initial window over 2^31 - 1")
                window = value  # the last one counts: the streams are walked once a frame, not once an entry
            elif key == f.ENABLE_PUSH and value > 1:
                raise ConnectionError_(f.PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}, neither 0 nor 1")
            elif key == f.MAX_FRAME_SIZE:
                if not f.DEFAULT_MAX_FRAME <= value <= (1 << 24) - 1:
                    raise ConnectionError_(f.PROTOCOL_ERROR, "a maximum frame size out of range")
                self.peer_max_frame = value
        out.append(f.frame(f.SETTINGS, f.ACK, 0))
        if window is not None and window != self.peer_window:
            delta, self.peer_window = window - self.peer_window, window
            for stream in self.streams.values():
                stream.send_window += delta
                if stream.send_window > f.MAX_WINDOW:  # RFC 9113 6.9.2
                    raise ConnectionError_(f.FLOW_CONTROL_ERROR, "a new initial window takes a stream's past 2^31 - 1")
            if delta > 0:  # the streams that waited for their own window, as those that wait for the connection's
                for stream in [s for s in self.streams.values() if s.pending]:
                    self._answering()
                    self._flush(stream, out)

    def _window_update(self, stream_id: int, increment: int, out: list[bytes]) -> None:
        if stream_id == 0:
            if not increment:
                raise ConnectionError_(f.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0 on the connection")
            self.send_window += increment
            if self.send_window > f.MAX_WINDOW:
                raise ConnectionError_(f.FLOW_CONTROL_ERROR, "the connection's window over 2^31 - 1")
            self._unblock(out)
            return
        stream = self.streams.get(stream_id)
        if stream is not None:
            if not increment:
                self._stream_error(stream_id, f.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0", out)
                return
            stream.send_window += increment
            if stream.send_window > f.MAX_WINDOW:
                self._stream_error(stream_id, f.FLOW_CONTROL_ERROR, "a stream's window over 2^31 - 1", out)
            elif stream.pending:
                self._flush(stream, out)

    # -- what the calls use --

    async def message(self, stream: Stream, *, only: bool = False) -> bytes | None:
        """The stream's next request message; None once the client has sent its last. `only`: the call takes this
        one message (a unary or server-streaming method), and fails with a second (the module docstring)."""
        while True:
            if stream.error is not None:
                raise stream.error
            if stream.messages:
                message = stream.messages.popleft()
                stream.queued -= len(message)
                if only and (stream.messages or stream.buffer or stream.error_after):  # a second, whole or begun
                    error = Unimplemented(MORE_THAN_ONE)
                    self._fail(stream, error)
                    raise error
                stream.single = only
                self._hold(stream)
                if stream.arriving is not None:  # its clock stood while the call had a message to read
                    stream.arriving = self.server.loop.time()
                if stream.credit and not stream.remote_closed and not stream.messages:
                    self._write(f.window_update(stream.id, stream.credit))
                    stream.credit = 0
                return message
            if stream.error_after is not None:
                self._fail(stream, stream.error_after)
                raise stream.error_after
            if stream.remote_closed:
                return None
            stream.waiter = self.server.loop.create_future()
            await stream.waiter
            stream.waiter = None

    def respond(self, stream: Stream, message: bytes, trailer: bytes) -> None:
        """A unary call's answer: headers, the message, the trailers; in one write when the windows allow."""
        if stream.closed:
            return
        stream.closed = True
        self._answering()
        n = len(message) + 5
        head = b"" if stream.headers_sent else self._response_headers(stream)
        stream.headers_sent = True
        body = b"\x00" + len(message).to_bytes(4, "big") + message
        if not stream.pending and n <= stream.send_window and n <= self.send_window and n <= self.peer_max_frame:
            stream.send_window -= n
            self.send_window -= n
            self._write(
                head
                + f.frame(f.DATA, 0, stream.id, body)
                + f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, stream.id, trailer)
                + self._stop_reading(stream)
            )
            self._done(stream)
            return
        out = [head] if head else []
        stream.pending += body
        stream.trailer = trailer
        self._flush(stream, out)
        self._write(b"".join(out))

    async def send(self, stream: Stream, message: bytes) -> None:
        """One message of a streamed answer; waits while the peer's windows hold earlier ones back."""
        if stream.closed:
            raise asyncio.CancelledError()  # the client reset it: the handler's loop ends here
        self._answering()
        out = []
        if not stream.headers_sent:
            out.append(self._response_headers(stream))
            stream.headers_sent = True
        stream.pending += b"\x00" + len(message).to_bytes(4, "big") + message
        self._flush(stream, out)
        self._write(b"".join(out))
        while stream.pending and not stream.closed:
            stream.drained = self.server.loop.create_future()
            await stream.drained

    def finish(self, stream: Stream, trailer: bytes) -> None:
        """End the stream with these trailers: after what it still sends, or as the whole answer
        (trailers-only) if it sent nothing."""
        if stream.closed:
            return
        if isinstance(stream.error, UnknownEncoding):
            trailer += f.ACCEPT_ENCODING  # a header block is its fields one after another
        stream.closed = True
        self._answering()
        out: list[bytes] = []
        if not stream.headers_sent and not stream.initial:
            stream.headers_sent = True
            self._write(
                f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, stream.id, f.RESPONSE_HEADERS + trailer)
                + self._stop_reading(stream)
            )
            self._done(stream)
            return
        if not stream.headers_sent:  # the handler's initial metadata, then the trailers on their own
            out.append(self._response_headers(stream))
            stream.headers_sent = True
        stream.trailer = trailer
        self._flush(stream, out)
        self._write(b"".join(out))

    def set_initial(self, stream: Stream, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        """The call's initial metadata, sent as its response's headers, with its first message or before its
        trailers (grpc.aio sends them at once, which a client cannot tell apart)."""
        if stream.headers_sent:
            raise RuntimeError("the call's initial metadata was sent already")
        stream.initial = f.header_block([(key, f.metadata_value(key, value)) for key, value in metadata])

    def _response_headers(self, stream: Stream) -> bytes:
        return f.frame(f.HEADERS, f.END_HEADERS, stream.id, f.RESPONSE_HEADERS + stream.initial)

    def time_remaining(self, stream: Stream) -> float | None:
        if stream.deadline is None:
            return None
        return max(0.0, stream.deadline - self.server.loop.time())

    def goaway(self) -> None:
        """No new streams on this connection: the ones open are served, and those the client sent before it read
        our GOAWAY too; it closes after the last (the module docstring)."""
        if self.going_away or self.transport is None or self.lingering is not None:
            return
        self.going_away = True
        self._write(f.goaway(f.MAX_WINDOW, f.NO_ERROR) + f.frame(f.PING, 0, 0, GOAWAY_PING))
        self.final_goaway = self.server.loop.call_later(GOAWAY_ACK_WAIT_S, self._refuse_new_streams)

    def _refuse_new_streams(self) -> None:
        """The final GOAWAY: the client has read the first (its PING came back), or did not answer in time."""
        if self.final_goaway is not None:
            self.final_goaway.cancel()
            self.final_goaway = None
        self.refusing = True
        self._write(f.goaway(self.last_stream, f.NO_ERROR))
        if not self.streams:
            self._end()

    def _end(self, linger: float = LINGER_S) -> None:
        """No call left on a connection going away: our end of it, then the client's, for `linger` seconds at
        most (the module docstring)."""
        transport = self.transport
        if transport is None or transport.is_closing() or self.lingering is not None:
            return
        self.refusing = True
        if self.reading:  # after what the frames read make (data_received)
            self.end_after_reading = linger
            return
        if self.handshake is not None:  # its abort would reset the connection, and cut an answer short
            self.handshake.cancel()
            self.handshake = None
        if not transport.can_write_eof():  # TLS: its close_notify ends our side
            transport.close()
            return
        try:
            transport.write_eof()  # sent once what is buffered has gone
        except OSError:  # reset since our last write (a client gone answers it so, on loopback within the send)
            transport.abort()
            return
        self.lingering = self.server.loop.call_later(linger, transport.close)

    def abort(self) -> None:
        """Cut the connection now (the end of a grace period): its calls are cancelled."""
        if self.transport is not None:
            self.transport.abort()

    def cut(self) -> None:
        """The end of a grace period: a connection with calls open is cut (abort); one with none gets the final
        GOAWAY and our end of it, reading what still comes until its client closes, as a connection sent away
        at any other time: a reset as its client writes (the PING's answer, a call) can cost it the GOAWAY."""
        if self.streams or self.transport is None:
            self.abort()
        else:
            self._refuse_new_streams()

    # -- frames out --

    def _flush(self, stream: Stream, out: list[bytes]) -> None:
        """As much of the stream's pending DATA as the windows allow, then its trailers once all is out."""
        pending = stream.pending
        while pending and stream.send_window > 0 and self.send_window > 0:
            n = min(len(pending), stream.send_window, self.send_window, self.peer_max_frame)
            out.append(f.frame(f.DATA, 0, stream.id, bytes(pending[:n])))
            del pending[:n]
            stream.send_window -= n
            self.send_window -= n
        if pending:
            # Waiting for the connection's window, which _unblock gives out, or for its own, which its
            # WINDOW_UPDATE (or SETTINGS) gives: a connection's WINDOW_UPDATE walks only the first kind (walking
            # a thousand streams stalled on their own windows for every one, a client could keep the loop busy).
            if stream.send_window > 0:
                self.blocked[stream.id] = stream
            else:
                self.blocked.pop(stream.id, None)
            return
        self.blocked.pop(stream.id, None)
        if stream.drained is not None and not stream.drained.done():
            stream.drained.set_result(None)
        if stream.trailer is not None:
            out.append(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, stream.id, stream.trailer))
            out.append(self._stop_reading(stream))
            stream.trailer = None
            # Out before _done: for the last call on a connection sent away, _done sends our end of it, and
            # nothing is written after that (the client read every answer, then UNAVAILABLE "Socket closed").
            self._write(b"".join(out))
            out.clear()
            self._done(stream)

    def _unblock(self, out: list[bytes]) -> None:
        for stream in list(self.blocked.values()):
            if self.send_window <= 0:
                return
            self._answering()
            self._flush(stream, out)

    def _stop_reading(self, stream: Stream) -> bytes:
        # The answer is complete while the client may still be sending: tell it to stop (RFC 9113 8.1).
        return b"" if stream.remote_closed else f.rst_stream(stream.id, f.NO_ERROR)

    def _expire(self, stream: Stream) -> None:
        stream.timer = None
        if stream.pending and self.streams.get(stream.id) is stream:
            # Its answer waits for a window its client does not give: past the deadline it is of no use, and held
            # it would keep its bytes for as long as the client likes (a review's finding). Reset, let go.
            out: list[bytes] = []
            self._reset(stream.id, f.CANCEL, out)
            self._write(b"".join(out))  # before the drop, which ends a connection sent away with its last stream
            self._drop(stream.id)
            return
        if stream.task is not None and not stream.task.done():
            stream.expired = True
            stream.task.cancel()

    def _abandon(self, stream: Stream) -> None:
        """The client reset the stream or the connection is gone: its call is cancelled, nothing is sent."""
        stream.closed = stream.reset = True
        self._let_go(stream)
        if stream.timer is not None:
            stream.timer.cancel()
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
        if stream.drained is not None and not stream.drained.done():
            stream.drained.set_result(None)
        stream.wake()

    def _abandon_all(self) -> None:
        """Every stream abandoned (`_abandon`) and forgotten: the connection is gone, or ended for an error."""
        for stream in list(self.streams.values()):
            self._abandon(stream)
        self.streams.clear()
        self.blocked.clear()

    def _done(self, stream: Stream) -> None:
        self._remember(stream.id, reset=not stream.remote_closed)  # _stop_reading reset it
        self._let_go(stream)
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        self.streams.pop(stream.id, None)
        self.blocked.pop(stream.id, None)
        self.last_call = self.server.loop.time()
        if (self.refusing or self.peer_going_away) and not self.streams:
            self._end()

    # -- what the requests still arriving hold (incoming.py) --

    def _hold(self, stream: Stream) -> None:
        """Count what the stream holds now in the server's Incoming, and start or stop its message's clock."""
        held = 0 if stream.probe else len(stream.buffer) + stream.queued  # a probe's: PROBE_BYTES
        self.server.incoming.held += held - stream.held
        stream.held = held
        if not stream.buffer:
            stream.arriving = None
        elif stream.arriving is None:
            stream.arriving = self.server.loop.time()

    def _let_go(self, stream: Stream) -> None:
        """The stream's messages, read or not, are no longer needed."""
        stream.buffer.clear()
        stream.messages.clear()
        stream.queued = 0
        self._hold(stream)

    def _fail(self, stream: Stream, error: ServiceError) -> None:
        """The call fails with `error` at its next read; what it holds is let go, and the rest of its request is
        not read (its DATA is still credited back)."""
        stream.error = error
        self._let_go(stream)
        stream.wake()

    def _second_message(self, stream: Stream) -> None:
        """Request bytes past the one message of a call that takes one, which its handler is running with: the
        call fails (the module docstring), its handler cancelled, and calls.py answers it once the handler has
        unwound (or returned: a handler may not stop). As a client's reset does, the cancel reaches the
        interceptors, which count the call CANCELLED. What the client sends once we have answered is dropped: after
        the answer has gone out the stream has ended; while it waits for the client's window it goes out as it is,
        OK, and a line saying the call failed would be wrong."""
        if stream.closed:  # answered (respond or finish), the answer held back by the client's window
            return
        log.debug("failing a gRPC call from %s: %s", self.peer or "a client", MORE_THAN_ONE)
        self._fail(stream, Unimplemented(MORE_THAN_ONE))
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()

    def expire_arrivals(self, before: float) -> None:
        """Fail the calls whose message began to arrive before `before` and is still incomplete, unless the call
        has a message it has not read (then we hold the client's window back, and its clock stands). A client that
        has read nothing we wrote since `before` is cut."""
        if self.paused:  # nothing arrives while we do not read: the clocks restart when we do
            if self.transport is None:
                return
            sent = self._gone_out()
            if sent > self.sent:  # some went out: a client that reads, if slowly (a slow link), is no stall
                self.sent, self.paused_at = sent, self.server.loop.time()
            elif self.paused_at < before:
                # As long a time as a message has to arrive, and the client took none of what we wrote: whatever
                # its calls hold (their messages under way, in --max-incoming-bytes, and their answers) would be
                # held for as long as it likes, the budget shared by every client with it (a review's finding:
                # a client that stopped reading kept the others' calls refused RESOURCE_EXHAUSTED).
                log.info("closing a gRPC connection from %s: it read nothing we wrote for %g s", self.peer,
                         self.server.message_timeout)  # fmt: skip
                self.transport.abort()
            return
        for stream in list(self.streams.values()):
            if stream.arriving is not None and stream.arriving < before and not stream.messages:
                timeout = self.server.message_timeout
                log.debug("failing a gRPC call from %s whose message took more than %g s", self.peer, timeout)
                self._fail(
                    stream,
                    RequestTimeout(
                        f"the request message took more than {timeout:g} s to arrive (--http-header-timeout)"
                    ),
                )

    def _gone_out(self) -> int:
        """How much of what we wrote the client has taken (connections.unsent: the kernel's bytes counted)."""
        assert self.transport is not None
        return self.written - unsent(self.transport)

    def _write(self, data: bytes) -> None:
        if self.greeting:  # our preface before anything else
            data, self.greeting = self.greeting + data, b""
        if data and self.transport is not None and not self.transport.is_closing() and self.lingering is None:
            self.transport.write(data)
            self.written += len(data)

    def _http1(self, data: bytes) -> bool:
        """An HTTP/1.x request where the client's preface should be (curl http:// to the gRPC port): answered 400
        in HTTP/1.1 saying what the port speaks, then our end sent (True); True too while its request line may
        still be coming; False for anything else."""
        if http1_request_target(data) is None:
            line = data[:MAX_REQUEST_LINE]
            return b"\r\n" not in line and len(line) < MAX_REQUEST_LINE and line.split(b" ", 1)[0].isalpha()
        assert self.transport is not None  # data_received reads nothing once it is gone or we have ended
        log.info("answered an HTTP/1.x request on the gRPC port from %s", self.peer or "a client")
        self.greeting = b""
        self.transport.write(HTTP1_ANSWER)
        self._end()  # what the client still sends is dropped (data_received), then the connection closes
        return True

    def _close(self, code: int, message: str, out: list[bytes]) -> None:
        """A connection error: what the frames read made, the GOAWAY that says why, the calls still open cancelled,
        and our end as a drain's (the module docstring), reading and dropping what the client still sends for
        ERROR_LINGER_S. Closed outright, the socket was reset by whatever the client sent after it, which failed
        the client's write before it read the GOAWAY, and discarded the GOAWAY itself where it had not yet left."""
        log.info("closing a gRPC connection from %s: %s", self.peer or "a client", message)
        out.append(f.goaway(self.last_stream, code, message.encode("utf-8", "replace")[:256]))
        self._write(b"".join(out))
        # Gone, as connection_lost has them: a stream left would have a stop's end of its grace period reset the
        # connection as one with calls open (`cut`), where their handlers only unwind.
        self._abandon_all()
        self._end(ERROR_LINGER_S)

    def _handshake_expired(self) -> None:
        self.handshake = None
        if self.transport is not None:
            self.transport.abort()


def _grpc_content_type(value: str) -> bool:
    """application/grpc, alone or with a +format or ;parameters, as gRPC's protocol names it ("application/grpcfoo"
    is no gRPC call)."""
    return value.startswith("application/grpc") and value[16:17] in ("", "+", ";")


def _unpad(payload: bytes) -> bytes:
    if not payload or payload[0] >= len(payload):
        raise ConnectionError_(f.PROTOCOL_ERROR, "padding longer than its frame")
    return payload[1 : len(payload) - payload[0]]
