"""Client connections a server process holds open, over both protocols, against one limit below its file descriptors.

Every connection holds a file descriptor, and a process may hold only so many (RLIMIT_NOFILE: 1024 in many
containers). At that limit a listening socket's `accept` fails with EMFILE, and Python 3.11's asyncio then logs the
failure, traceback and all, once for every connection waiting in the listen backlog, and retries each second: a
server allowed 256 descriptors and sent 600 idle connections wrote 716,852 log lines in 15 s, answered no new
client, and could not read its model repository (no descriptor left to open a file with). So:

- at start-up the process raises its soft limit of descriptors to the hard one, as Go's runtime does;
- connections are admitted up to a limit (--max-connections; by default the descriptors less RESERVE, at most
  DEFAULT_LIMIT), counted over the lean gRPC front and HTTP together, so that the server's own files, pipes,
  the repository poll and the metrics port's scrapes always find a descriptor;
- asyncio accepts at most ACCEPT_BATCH connections each time a listening socket is ready (it took as many as
  the backlog, 1024, before any of them was counted);
- should the descriptors run out all the same, asyncio's line about it is written once a minute at most;
- a connection over the limit takes the place of the oldest held connection that is silent, one that has sent
  no request since it connected (HTTP: no request's headers whole; the lean front: no call opened; TLS: its
  handshake not done), which is cut, as the metrics port makes room (service/metrics.py). Connections that
  sent nothing (or a request line's first byte, or an HTTP/2 preface) and were reopened as the header timeout
  closed them held the limit otherwise, cheaply, and every
  new connection was refused: the kubelet's liveness probe among them, which restarted a healthy pod. One that
  began (a preface, a request line's start, a ClientHello) less than BEGUN_GRACE ago is cut only when none that
  sent nothing is left: a real client's connection is begun for a round trip (a gRPC client opens its call once
  our SETTINGS come), and a burst of connections that sent nothing cut it meanwhile, failing its call
  UNAVAILABLE; past the grace the older goes, so that connections that sent a byte long ago do not outlast
  every new one (which would then cut each other, a probe among them). A connection
  that has carried requests is never cut so, even idle (its client may be sending the next one as it closes).
  Each is counted in `mhaserve_connections_closed_silent_total`, by the protocol of the one cut;
- with none silent, the new connection is closed at once, the server's answer to it depending on its protocol (the
  lean front closes it unread: a gRPC client then reports UNAVAILABLE at once and waits its reconnect backoff; HTTP
  answers 503 with Retry-After, at most ANSWERED_AT_ONCE at a time). Each is counted in
  `mhaserve_connections_refused_total`.

A TLS connection is counted from its accept, not from the end of its handshake (`create_server`): asyncio tells
the protocol of a connection only once its handshake is done, and never of one that failed, so silent connections
to a TLS port held a descriptor each, uncounted, for the whole handshake timeout: 640 of them took every descriptor
of a server allowed 320 (tests/security/test_tls.py).

grpc.aio's front accepts connections in grpc core, out of our count: it gets the same limit as a channel option
of its own (`grpc.max_allowed_incoming_connections`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import logging
import resource
import socket
import ssl
import struct
import sys
import termios
import time
from asyncio import sslproto
from collections.abc import Callable
from functools import partial
from http import HTTPStatus

from prometheus_client import Counter

from mhaserve.service.context import Throttle

log = logging.getLogger(__name__)

# Descriptors a server process keeps for itself besides its client connections: its listening sockets, the
# model files and the repository poll, log files, the event loop's and the thread pools' pipes, ONNX Runtime,
# the metrics port (a thread and a descriptor per scrape, each cut after 10 s), and new connections between their
# accept and the count (up to ACCEPT_BATCH a listener each time its socket is ready, for 2-3 turns of the loop).
RESERVE = 256
# Connections a process admits by default at most, whatever its descriptors: far more than its clients need (a
# gRPC client holds one connection, an HTTP client's pool 10 to 100), and a bound on the memory they hold
# (uvicorn reads up to 64 KiB ahead on each, 256 MiB at this limit). --max-connections sets another.
DEFAULT_LIMIT = 4096
# asyncio's accept loop takes up to its server's `backlog` connections each time the listening socket is ready,
# before any protocol sees one (CPython's bpo-27906): a burst of new connections took 1024 descriptors at once, past
# any limit, and on EMFILE it schedules a retry for each one it could not take. So both fronts create their servers
# with this as `backlog` and then give the kernel's queue its own length again (`bounded_accepts`).
ACCEPT_BATCH = 16
# The longest a stop accepts its listen queue (stop_accepting): a full one (2,048) takes some 130 turns of the loop.
QUEUE_S = 1.0
# Linux's TCP_INFO (netinet/tcp.h), and where its `tcpi_unacked` lies: after 8 one-byte fields and 4 of 32 bits.
TCP_INFO = getattr(socket, "TCP_INFO", 11)
TCP_INFO_UNACKED = 24
ANSWERED_AT_ONCE = RESERVE // 4  # refused connections answered at once, at most (ConnectionLimit.start_answer)
# How long a connection that began (ConnectionLimit.began) is spared while one that sent nothing is left to cut:
# a round trip or two, for a real client to open its call or send its request's headers; past it, age decides.
BEGUN_GRACE = 1.0
FEWEST = 16  # the least the default gives, on a process with very few descriptors
# Linux refuses a soft limit over fs.nr_open, whatever the hard limit; its default is 2**20.
NR_OPEN = "/proc/sys/fs/nr_open"


def raise_file_limit() -> tuple[int, int]:
    """Raise the process's soft limit of open files to its hard limit (Linux caps it at fs.nr_open); returns the
    soft limit before and after. A limit that cannot be raised (a sandbox's) is left as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open(NR_OPEN) as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return soft, soft
        return soft, target
    return soft, soft


# asyncio's line for an accept that failed for want of a descriptor, with its traceback: written once for every
# connection waiting in the backlog, each time the listener is tried again (the module docstring). Should the
# descriptors run out all the same (the metrics port's scrapes are not counted), one line a minute of it.
ACCEPT_FAILED = Throttle(("socket.accept() out of system resource",))


def throttle_accept_failures() -> None:
    """Put ACCEPT_FAILED on asyncio's logger (once: servers in one process share it)."""
    logger = logging.getLogger("asyncio")
    if ACCEPT_FAILED not in logger.filters:
        logger.addFilter(ACCEPT_FAILED)


def bounded_accepts(sock: socket.socket, backlog: int) -> None:
    """After asyncio's create_server(sock=sock, backlog=ACCEPT_BATCH): the kernel's queue of connections not yet
    accepted back at `backlog` (a listening socket takes a new length)."""
    sock.listen(backlog)


async def stop_accepting(socks: list[socket.socket]) -> None:
    """Take no more connections from the listening sockets `socks` (an asyncio Server's), and let those already
    taken get their transport and protocol; then the Server may close. asyncio accepts a socket in one turn of the
    loop and makes its transport in a task the next; closing the Server in between fails that transport (Python
    3.11's Server._attach asserts it still listens, and asyncio drops the error), and the socket stays open,
    unread, until the garbage collector finds it: its client waits for its deadline, not told to go elsewhere.

    First, what the kernel holds in the listen queue (handshakes done, nothing accepted: the loop was busy) is
    accepted, turn after turn of the loop for as long as each turn shortens the queue: closed with the socket,
    each was reset after its client had sent its request, which it cannot tell from a request lost midway (a
    proxy retries only a refused connect, or an idempotent request); accepted now, each is sent away as the front
    sends away a connection during a stop (HTTP's 503, gRPC's GOAWAY). Under a flood that fills it as fast, it is
    not waited for, and for QUEUE_S at most in any case. A connection whose handshake ends after the last turn is
    still reset."""
    loop = asyncio.get_running_loop()
    queued, idle, end = sum(accept_queue(sock) for sock in socks), 0, loop.time() + QUEUE_S
    # A turn in which asyncio's accepting reads the queue (ACCEPT_BATCH at a time), after this coroutine's step in
    # the same turn: so a turn that shortened nothing is looked at again once before giving up.
    while queued and idle < 2 and loop.time() < end:
        await asyncio.sleep(0)
        before, queued = queued, sum(accept_queue(sock) for sock in socks)
        idle = idle + 1 if queued >= before else 0
    for sock in socks:
        loop.remove_reader(sock.fileno())  # the Server's accepting; also cancels an accept due this turn
    # An accept of this turn or the last made its transport's task for the next turn, which these two await.
    for _ in range(2):
        await asyncio.sleep(0)


def accept_queue(sock: socket.socket) -> int:
    """How many connections the kernel holds for the listening socket `sock`, handshakes done and not accepted:
    Linux's TCP_INFO of a listening socket gives its accept queue's length as `tcpi_unacked`. 0 where it cannot
    tell (another system, another kind of socket)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, TCP_INFO, TCP_INFO_UNACKED + 4)
    except (OSError, AttributeError):
        return 0
    return int.from_bytes(info[TCP_INFO_UNACKED : TCP_INFO_UNACKED + 4], sys.byteorder)


def default_limit(files: int) -> int:
    """--max-connections when it is not set, for a process that may hold `files` descriptors."""
    return max(FEWEST, min(DEFAULT_LIMIT, files - RESERVE))


class ConnectionLimit:
    """The count of open client connections against `limit`. Used on the event loop only: both fronts serve on it.

    A connection past the limit cuts the oldest silent one (the module docstring) and takes its place, counted in
    `closed_silent` (by the protocol of the one cut, and in the metric when given); with none silent it is refused,
    counted in `refused` (by protocol, and in the metric when given). Each is logged as a warning, at most one line
    a minute of each: a client pool that keeps reconnecting would otherwise write a line for each attempt."""

    def __init__(
        self,
        limit: int,
        *,
        refused: Counter | None = None,
        closed_silent: Counter | None = None,
        log_every: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        grace: float | None = None,
    ) -> None:
        self.limit = limit
        self.grace = BEGUN_GRACE if grace is None else grace
        # Set as the server stops: the connections it still accepts (its listen queue) are only sent away, and a
        # silent connection is not cut for one (admit).
        self.stopping = False
        self._clock = clock
        self.open = 0
        self.answering = 0  # refused connections still being answered (start_answer)
        self.refused: collections.Counter[str] = collections.Counter()
        self.closed_silent: collections.Counter[str] = collections.Counter()
        # A TLS connection's protocol -> whether it was admitted at its accept (True) or refused with a place to be
        # answered (False), until the protocol's own admit() takes that over at the end of the handshake.
        self._at_accept: dict[asyncio.BaseProtocol, bool] = {}
        # The silent connections: protocol -> (its front's name, its transport, to cut it with, its admission's
        # number), those that sent nothing in the order admitted, those that began (`began`) in the order they
        # began, each with the time it did. A connection that began less than `grace` ago is cut only when none
        # that sent nothing is left: a real client's connection is begun for a round trip or two (a gRPC client
        # waits for our SETTINGS before it opens a call, TLS for our ServerHello), and a burst of connections that
        # sent nothing, accepted after it, cut it meanwhile. Past the grace, the older is cut: else connections
        # that sent one byte long ago would outlast every new one, which then cut each other (a probe among them).
        self._silent: dict[asyncio.BaseProtocol, tuple[str, asyncio.Transport, int]] = {}
        self._begun: dict[asyncio.BaseProtocol, tuple[str, asyncio.Transport, int, float]] = {}
        self._admitted = 0  # connections admitted so far: each one's number orders them by age
        self._cut: set[asyncio.BaseProtocol] = set()  # cut to make room: their place already passed on
        self._metric = refused
        self._closed_metric = closed_silent
        self._lines = Throttle((), interval=log_every, clock=clock)

    def admit(
        self,
        protocol: str,
        connection: asyncio.BaseProtocol | None = None,
        transport: asyncio.Transport | None = None,
    ) -> bool:
        """Count a new connection of `protocol` in, or, at the limit, refuse it (the caller closes it). `connection`,
        its protocol, and `transport`, its transport: it is silent until spoke(), cut meanwhile should a new one
        need its place. A TLS connection was admitted or refused at its accept (`create_server`), and keeps that."""
        if connection is not None and connection in self._at_accept:
            if self._at_accept[connection]:
                del self._at_accept[connection]
                self._add_silent(protocol, connection, transport)  # still silent, as old as its accept
                return True
            return False  # refused at its accept: start_answer() takes the answer's place it holds
        if self.open < self.limit:
            self.open += 1
        elif self.stopping or not self._make_room(protocol):
            self._refuse(protocol)
            return False
        self._add_silent(protocol, connection, transport)
        return True

    def _refuse(self, protocol: str) -> None:
        self.refused[protocol] += 1
        if self._metric is not None:
            self._metric.labels(protocol).inc()
        self._warn(
            "refused",
            "refused a new %s connection: %d connections are open, the limit (--max-connections), and none is silent",
            protocol,
            self.open,
        )

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """`message`, at most once a minute of each `kind`, saying how many were left out since the last."""
        left_out = self._lines.passes(kind)
        if left_out is not None:
            log.warning("%s%s", message % args, f" ({left_out} more since the last such line)" if left_out else "")

    def _add_silent(
        self, protocol: str, connection: asyncio.BaseProtocol | None, transport: asyncio.Transport | None
    ) -> None:
        """A connection just admitted: silent until spoke(). One already there (a TLS connection's, from its accept)
        keeps its place in the order, oldest first, begun or not, and takes the transport of its protocol's."""
        if connection is None or transport is None:
            return
        if (begun := self._begun.get(connection)) is not None:
            self._begun[connection] = (protocol, transport, begun[2], begun[3])
        elif (silent := self._silent.get(connection)) is not None:
            self._silent[connection] = (protocol, transport, silent[2])
        else:
            self._admitted += 1
            self._silent[connection] = (protocol, transport, self._admitted)

    def _make_room(self, protocol: str) -> bool:
        """Cut a silent connection, whose place a new one of `protocol` takes: the older of the oldest that sent
        nothing and the first that began, unless that one began within the grace; the first that began if none
        sent nothing. False if none is silent."""
        nothing = next(iter(self._silent.items()), None)
        begun = next(iter(self._begun.items()), None)
        if begun is not None and (
            nothing is None or (self._clock() - begun[1][3] >= self.grace and begun[1][2] < nothing[1][2])
        ):
            oldest, (cut, transport, *_) = begun
            del self._begun[oldest]
        elif nothing is not None:
            oldest, (cut, transport, _) = nothing
            del self._silent[oldest]
        else:
            return False
        # Held at its accept (in its TLS handshake), the place goes with the entry, and the end of the handshake
        # gives nothing back; else its protocol's connection_lost will release() it, which then does nothing.
        if self._at_accept.pop(oldest, None) is None:
            self._cut.add(oldest)
        transport.abort()  # it sent nothing: nothing it said goes unanswered
        self.closed_silent[cut] += 1
        if self._closed_metric is not None:
            self._closed_metric.labels(cut).inc()
        self._warn(
            "closed",
            "closed the oldest silent %s connection (no request sent since it connected) for a new %s connection: %d "
            "connections are open, the limit (--max-connections)",
            cut,
            protocol,
            self.open,
        )
        return True

    def began(self, connection: asyncio.BaseProtocol) -> None:
        """`connection` has sent its first bytes, not yet a request (an HTTP/2 preface, a request line's start, a
        TLS ClientHello): still silent, but for the grace cut only once none that sent nothing is left. Nothing for
        one that began or spoke already."""
        entry = self._silent.pop(connection, None)
        if entry is not None:
            self._begun[connection] = (*entry, self._clock())

    @property
    def begun(self) -> int:
        """How many silent connections have begun."""
        return len(self._begun)

    def spoke(self, connection: asyncio.BaseProtocol) -> None:
        """`connection` has sent something of a request: no longer silent, it is never cut for a new one."""
        self._silent.pop(connection, None)
        self._begun.pop(connection, None)

    def start_answer(self, connection: asyncio.BaseProtocol | None = None) -> bool:
        """Take a place for answering a refused connection before it closes (HTTP's 503), if one is free: each
        holds a descriptor a moment, so at most ANSWERED_AT_ONCE are, and past them a refusal is closed unanswered.
        A TLS connection took its place at its accept."""
        if connection is not None and self._at_accept.get(connection) is False:
            del self._at_accept[connection]
            return True
        if self.answering >= ANSWERED_AT_ONCE:
            return False
        self.answering += 1
        return True

    def hold(
        self, connection: asyncio.BaseProtocol, admitted: bool, protocol: str, transport: asyncio.Transport
    ) -> None:
        """A TLS connection of `protocol` admitted (or refused, with an answer's place) at its accept, for
        `connection`, its protocol, to take over with admit() (and start_answer()) once its handshake is done; one
        admitted is silent meanwhile, cut with `transport`, its raw one."""
        self._at_accept[connection] = admitted
        if admitted:
            self._add_silent(protocol, connection, transport)

    def let_go(self, connection: asyncio.BaseProtocol) -> None:
        """A TLS connection's handshake has ended: what it held, if its protocol did not take it over, is free."""
        admitted = self._at_accept.pop(connection, None)
        if admitted is True:
            self.release(connection)
        elif admitted is False:
            self.end_answer()

    def end_answer(self) -> None:
        self.answering -= 1

    def release(self, connection: asyncio.BaseProtocol) -> None:
        """An admitted connection, `connection` its protocol, has closed."""
        self._silent.pop(connection, None)
        self._begun.pop(connection, None)
        if connection in self._cut:  # its place was a new one's already
            self._cut.discard(connection)
            return
        self.open -= 1


# What a front does with a connection to its TLS port whose first bytes are not a TLS handshake: given the protocol
# made for the connection, its transport, and those bytes, it answers them in its own protocol and returns True
# (the transport is then its, or it closed it), or returns False, and the handshake fails on them as it would.
Plaintext = Callable[[asyncio.BaseProtocol, asyncio.Transport, bytes], bool]
TLS_HANDSHAKE = 0x16  # the first byte of a TLS record that carries a handshake message (a ClientHello's)
MAX_REQUEST_LINE = 8 * 1024  # how far an HTTP/1.x request line is looked for


def unsent(transport: asyncio.Transport) -> int:
    """The bytes written to a connection that its peer has not taken yet: in the transport's buffer and in the
    kernel's, not yet acknowledged (Linux's SIOCOUTQ; elsewhere the transport's alone). The kernel's count: a
    peer that reads slowly frees a buffer of megabytes a little at a time, and the transport's moves only once a
    third of it is free, so that the transport's alone stood still for seconds while such a peer read."""
    held = transport.get_write_buffer_size()
    if isinstance(transport, sslproto._SSLProtocolTransport):  # and the TCP transport's under TLS, unbounded
        inner = getattr(transport._ssl_protocol, "_transport", None)
        if isinstance(inner, asyncio.WriteTransport):
            held += inner.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.fileno() >= 0:  # -1 once closed (a close with nothing unsent is at once)
        with contextlib.suppress(OSError):
            held += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0]
    return held


def plain_answer(status: int, text: str, request_id: str | None = None) -> bytes:
    """A whole HTTP/1.1 answer in plain text that closes the connection: for requests refused before any HTTP
    server reads them (headers over the limit, HTTP/1.x sent to a gRPC port)."""
    body = text.encode() + b"\n"
    return (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n".encode()
        + (f"x-request-id: {request_id}\r\n".encode() if request_id else b"")
        + b"content-length: "
        + str(len(body)).encode()
        + b"\r\nconnection: close\r\n\r\n"
        + body
    )


def http1_request_target(data: bytes) -> bytes | None:
    """The target (path) of the HTTP/1.x request line `data` starts with; None if it starts with none."""
    line, found, _ = data[:MAX_REQUEST_LINE].partition(b"\r\n")
    parts = line.split(b" ")
    if not found or len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return None
    return parts[1]


async def create_server(
    loop: asyncio.AbstractEventLoop,
    factory: Callable[[], asyncio.BaseProtocol],
    *,
    sock: socket.socket,
    context: ssl.SSLContext | None,
    handshake_timeout: float,
    limit: ConnectionLimit | None,
    protocol: str,
    answer_refused: bool,
    plaintext: Plaintext | None = None,
    backlog: int = ACCEPT_BATCH,
) -> asyncio.Server:
    """`loop.create_server` on `sock`, TLS with `context`, whose connections are counted against `limit` from their
    accept. The protocols `factory` makes count themselves in on `connection_made`, with `limit.admit(protocol,
    self)`, and out on `connection_lost`; asyncio calls both only for a connection whose handshake succeeded. So the
    TLS layer is put under them here, at the accept, where the connection is admitted (or refused: closed at once,
    or, with `answer_refused`, let through its handshake to be answered when an answer's place is free), and a
    handshake that fails or times out gives its place back. A client that speaks plaintext to the port is
    answered by `plaintext`, in words it reads, where a failed handshake would only have closed its connection."""
    if context is None or limit is None:
        return await loop.create_server(
            factory,
            sock=sock,
            ssl=context,
            ssl_handshake_timeout=handshake_timeout if context is not None else None,
            backlog=backlog,
        )
    return await loop.create_server(
        partial(_Handshake, loop, factory, context, handshake_timeout, limit, protocol, answer_refused, plaintext),
        sock=sock,
        backlog=backlog,
    )


class _Handshake(asyncio.Protocol):
    """A TLS connection's protocol from its accept to its first bytes: it admits the connection, then hands the
    transport to asyncio's TLS protocol, with the server's protocol above it, as `loop.create_server(ssl=...)`
    would; or, if those bytes are not a TLS handshake, to the front's `plaintext`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        factory: Callable[[], asyncio.BaseProtocol],
        context: ssl.SSLContext,
        timeout: float,
        limit: ConnectionLimit,
        protocol: str,
        answer_refused: bool,
        plaintext: Plaintext | None,
    ) -> None:
        self.loop, self.factory, self.context, self.timeout = loop, factory, context, timeout
        self.limit, self.protocol, self.answer_refused, self.plaintext = limit, protocol, answer_refused, plaintext
        self.transport: asyncio.Transport | None = None
        self.app: asyncio.BaseProtocol | None = None
        self.accepted = 0.0
        self.deadline: asyncio.TimerHandle | None = None
        self.answered = False  # by `plaintext`, on this protocol: what comes next is dropped

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        limit = self.limit
        admitted = limit.admit(self.protocol)
        if not admitted and not (self.answer_refused and limit.start_answer()):
            transport.abort()
            return
        self.transport = transport
        self.app = self.factory()
        limit.hold(self.app, admitted, self.protocol, transport)
        self.accepted = self.loop.time()
        self.deadline = self.loop.call_later(self.timeout, transport.abort)  # no first byte: as a silent handshake

    def data_received(self, data: bytes) -> None:
        transport, app = self.transport, self.app
        assert transport is not None and app is not None
        if self.answered:
            return
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if data[0] == TLS_HANDSHAKE:  # its ClientHello: its handshake's round trip is spared for the grace
            self.limit.began(app)
        if data[0] != TLS_HANDSHAKE and self.plaintext is not None and self.plaintext(app, transport, data):
            if transport.get_protocol() is not self:  # the front's protocol took it over, and the place with it
                self.limit.let_go(app)
                return
            # Answered here, its end sent: what the client still sends is dropped until it closes its end, for at
            # most the handshake's time (closing at once would reset a connection with unread bytes, and the
            # reset can cost the client the answer). Its place is given back in connection_lost.
            self.answered = True
            self.deadline = self.loop.call_later(self.timeout, transport.close)
            return
        handshake = self.loop.create_future()
        handshake.add_done_callback(partial(_handshake_ended, self.limit, app))
        # What loop.start_tls does, but with the server's protocol told of the connection by the TLS layer itself
        # when the handshake is done: start_tls leaves that to its caller, after the TLS layer may already have
        # passed the protocol the client's first request. The bytes read so far go to the TLS layer first. Its
        # timeout is what is left of the handshake's (typeshed has it an int; asyncio takes seconds as a float).
        tls = sslproto.SSLProtocol(
            self.loop,
            app,
            self.context,
            handshake,
            server_side=True,
            ssl_handshake_timeout=max(0.001, self.timeout - (self.loop.time() - self.accepted)),  # type: ignore[arg-type]
        )
        transport.set_protocol(tls)
        tls.connection_made(transport)
        view = memoryview(data)
        while view and not transport.is_closing():  # a handshake failed on the first bytes closes it
            buffer = tls.get_buffer(len(view))
            n = min(len(buffer), len(view))
            buffer[:n] = view[:n]
            tls.buffer_updated(n)
            view = view[n:]

    def connection_lost(self, exc: Exception | None) -> None:
        """Closed before its first bytes were handed on (the client gone, the deadline passed), or after the front's
        `plaintext` answered it on this protocol."""
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if self.app is not None:
            self.limit.let_go(self.app)


def _handshake_ended(limit: ConnectionLimit, app: asyncio.BaseProtocol, handshake: asyncio.Future[None]) -> None:
    """A handshake's end, either way: if the server's protocol never took the connection's place over (a failed or
    timed-out handshake, or a connection closed during it), give it back."""
    if not handshake.cancelled():
        handshake.exception()  # retrieved: the failure is asyncio's to log (at debug), as for its own TLS servers
    limit.let_go(app)
