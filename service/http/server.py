"""The HTTP server: uvicorn on the server's own event loop, beside gRPC, with the same TLS material.

uvicorn is run piece by piece rather than through `Server.serve()`, which would install signal
handlers of its own: the process's signals belong to `mhaserve.service.server.serve`. The listening
socket is bound here, before the model loads (as the gRPC port is), so port 0 reports the port it got.

Two protections uvicorn's httptools protocol lacks, in `ReadTimeoutProtocol`: a client that trickles its
request headers (slowloris) would hold a connection for as long as it likes, so a connection whose headers
are not complete `read_timeout` seconds after the request began is closed (the body gets the same time,
middleware.py); and headers have no size limit (64 MB of them, before any key is checked, took the server
from 0.7 to 1.7 GB), so a request line and headers over MAX_HEADER_BYTES get a 431 and the connection is
closed, as nginx and Node refuse them; a chunked body's trailer section counts with them (its fields are
dropped, as nothing reads them).

A connection past the process's --max-connections (service/connections.py, counted with the lean gRPC front's)
takes the place of the oldest connection that has begun no request (a silent one, of either front), which is cut;
with none such it is turned away: its request line is read (for the body's shape, which depends on the API of the
route), answered 503 with Retry-After and `connection: close`, and the connection closed a moment later, as a 431
is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import ssl
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, cast

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mhaserve.runtime.errors import InvalidArgument, ServiceError, Unavailable
from mhaserve.service.connections import (
    ACCEPT_BATCH,
    MAX_REQUEST_LINE,
    ConnectionLimit,
    bounded_accepts,
    create_server,
    http1_request_target,
    plain_answer,
    stop_accepting,
    unsent,
)
from mhaserve.service.context import Throttle, accept_request_id
from mhaserve.service.dataplane import SHUTTING_DOWN
from mhaserve.service.http.errors import render

log = logging.getLogger(__name__)

BACKLOG = 2048
# An idle keep-alive connection is closed after this long; a balancer's pool must close its own sooner
# (deploy/nginx keeps its 4 s), or it sends requests on connections being closed; deploy/haproxy sends a request
# met by such a close to another replica instead (`retry-on empty-response`), but only one it holds whole in its
# buffer (16 kB): a larger one's client sees the close.
KEEP_ALIVE_S = 5
# The request line and headers together; nginx's default allows 4 lines of 8 KB, Node 16 KB in all.
MAX_HEADER_BYTES = 64 * 1024
LINGER_S = 2.0  # how long a refused connection's remaining bytes are read and dropped before it closes
TOO_LARGE = "the request line and headers are over 64 KiB in all"
METHOD_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ-"  # of the methods llhttp knows (M-SEARCH)
TOO_LARGE_TRAILERS = "the request's headers and its chunked body's trailer section are over 64 KiB in all"
UPGRADE_WITH_BODY = InvalidArgument(
    "this server takes no Upgrade (WebSocket, h2c): send the request in HTTP/1.1 without Upgrade (curl: --http1.1)"
)


# uvicorn logs a WARNING for every malformed request: a TLS handshake or an HTTP/2 client sent to the plain HTTP
# port, a load balancer's check in the wrong protocol, or a scanner, wrote a line a request and buried the log.
REQUEST_WARNINGS = Throttle(("Invalid HTTP request received.", "Unsupported upgrade request."))


def closing_answer(error: ServiceError, target: bytes) -> bytes:
    """A whole HTTP/1.1 response that answers a request for `target` with `error`, in its route's API's shape, and
    closes the connection: for requests refused before uvicorn reads them."""
    rid = accept_request_id(None)
    status, headers, body = render(error, target.decode("latin-1").partition("?")[0], rid)
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
    head += [name + b": " + value for name, value in headers]
    head += [b"content-length: " + str(len(body)).encode(), b"connection: close", b"x-request-id: " + rid.encode()]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def answer_plaintext(_protocol: asyncio.BaseProtocol, transport: asyncio.Transport, data: bytes) -> bool:
    """A plain HTTP request to the TLS port (connections.create_server's `plaintext`): answered 400 saying so, as
    Go's servers and nginx do, where a failed handshake would only close the connection ("Remote end closed
    connection without response")."""
    target = http1_request_target(data)
    if target is None:
        return False  # not HTTP/1.x either: the handshake fails on it
    error = InvalidArgument("this port speaks HTTPS, and the request came in plain HTTP: send it to https://")
    transport.write(closing_answer(error, target))
    transport.write_eof()  # then what else the client sends is read and dropped until it closes (create_server)
    return True


class _Trailers(list[tuple[bytes, bytes]]):
    """Where uvicorn puts a request's trailer fields once its headers are whole: each counted as headers are,
    and dropped."""

    def __init__(self, protocol: ReadTimeoutProtocol) -> None:
        super().__init__()
        self.protocol = protocol

    def append(self, field: tuple[bytes, bytes]) -> None:
        self.protocol._refuse_trailers(len(field[0]) + len(field[1]) + 4)


class ReadTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a deadline on receiving each request's headers."""

    read_timeout = 30.0  # set per server by HttpServer, on a subclass
    connection_limit: ConnectionLimit | None = None  # the same
    stopping = False  # the same, by its stop: a connection made after it began is turned away, answered 503

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._headers_deadline: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._in_headers = False  # between a request's first byte and the end of its headers
        self._in_body = False  # between the end of a request's headers and the end of the request
        # A chunked body: whether a chunk's size line has come and none of its data yet (after the last one, size 0,
        # the trailer section), and the bytes of the reads since; the trailer fields go to `_trailers`.
        self._chunk_waits = False
        self._chunks = 0  # size lines read on the connection, to tell a read after one from a read past it
        self._unfed = 0
        self._trailers = _Trailers(self)
        self._refused = False  # headers over the limit: answered 431, the connection closing
        self._begun_here = False  # a request began in the read being parsed
        self._refusal: bytes | None = None  # a 431 waiting for the answers of the requests pipelined before it
        self._admitted = False  # counted against --max-connections
        self._sent_away = False  # over the limit, or made as the server stops: uvicorn never sees it
        self._answering = False  # holds one of the limit's places for answers to turned-away connections
        # Over --max-connections, or made as the server stops: its request line as it arrives, and its answer.
        self._turned_away: bytearray | None = None
        self._away: ServiceError | None = None
        # While the transport holds more of an answer than its high-water mark, or closes with some of one unsent:
        # what was unsent at the last look, and the timer of the next (`_stalled`)
        self._unsent = 0
        self._stall: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._headers_deadline = self.loop.call_later(self.read_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._headers_deadline is not None:
            self._headers_deadline.cancel()
            self._headers_deadline = None

    def _too_slow(self) -> None:
        self._headers_deadline = None
        if self._turned_away is not None:  # sent no request line: closed unanswered
            self.transport.close()
        elif not self.transport.is_closing():
            log.info("closing an HTTP connection whose request headers took more than %g s", self.read_timeout)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        limit = self.connection_limit
        if limit is not None and not limit.admit("http", self, transport):
            if not limit.start_answer(self):  # a flood of them: each answer would hold a descriptor a moment
                self.transport, self._sent_away = transport, True
                transport.abort()
                return
            self._answering = True
            full = (
                f"the server holds its limit of {limit.limit} open connections (--max-connections): retry later, "
                "or on another replica"
            )
            self._send_away(transport, Unavailable(SHUTTING_DOWN if self.stopping else full))
            return
        self._admitted = limit is not None
        if self.stopping:
            # Accepted from the listen queue as the stop began (connections.stop_accepting): given to uvicorn, whose
            # stop closed it unread, it was reset with its request sent.
            self._send_away(transport, Unavailable(SHUTTING_DOWN))
            return
        super().connection_made(transport)
        # uvicorn writes a response's head and body as two sends; with Nagle's algorithm on, the body
        # waits for the client's delayed ACK of the head (~40 ms on Linux) on every keep-alive request.
        # asyncio turns Nagle off only for sockets made with IPPROTO_TCP, which ours is not.
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm()  # the first request's headers; keep-alive idle time is uvicorn's own timeout

    def _send_away(self, transport: asyncio.Transport, error: ServiceError) -> None:
        """Answer this connection's first request `error` once its request line has come (_turn_away), and close it;
        uvicorn never sees it."""
        self.transport, self._sent_away = transport, True
        self._turned_away, self._away = bytearray(), error
        self._arm()

    def _turn_away(self, data: bytes) -> None:
        """More of a turned-away connection's request: once its request line is whole, answer it 503."""
        assert self._turned_away is not None
        self._turned_away += data
        line, found, _ = bytes(self._turned_away[:MAX_REQUEST_LINE]).partition(b"\r\n")
        if not found and len(self._turned_away) < MAX_REQUEST_LINE:
            return
        self._disarm()
        self._turned_away = None
        self._refused = True  # what else comes is dropped
        parts = line.split(b" ")
        assert self._away is not None
        self.transport.write(closing_answer(self._away, parts[1] if len(parts) == 3 else b"/"))
        if self.transport.can_write_eof():
            self.transport.write_eof()  # as a 431's: the rest of the request read and dropped, then closed
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _count(self, size: int, said: str = TOO_LARGE) -> None:
        self._header_bytes += size
        if self._header_bytes > MAX_HEADER_BYTES and not self._refused:
            self._refused = True
            self._disarm()
            # A made-up id, as every answer carries one: the client's may lie past what is read.
            rid = accept_request_id(None)
            log.info("answered 431 (request %s): %s", rid, said)
            if said == TOO_LARGE and (self.pipeline or (self.cycle is not None and not self.cycle.response_complete)):
                # Pipelined behind requests still being answered: after them (written and closed at once, it cut
                # their answers off: "Cannot call write() after write_eof()").
                self._refusal = plain_answer(431, said, rid)
                return
            self._send_refusal(plain_answer(431, said, rid))

    # Once a 431 is given, the rest of the read the parser still goes through is no request: no upgrade (its scope
    # was never made), no 400 of uvicorn's for bytes that follow (written after the 431's end, or before it).
    def _should_upgrade(self) -> bool:
        return not self._refused and super()._should_upgrade()

    def _unsupported_upgrade_warning(self) -> None:
        pass  # every upgrade is declined in on_headers_complete, which says so to the client

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to bytes its parser refuses, with a request id, as every other answer has (uvicorn's
        # had none); closed at once, as uvicorn closes it
        if not self._refused:
            rid = accept_request_id(None)
            log.debug("answered 400 (request %s): %s", rid, msg)  # (uvicorn's warning, a minute's first, has no id)
            self.transport.write(plain_answer(400, msg, rid))
            self.transport.close()

    def _send_refusal(self, answer: bytes) -> None:
        if self.timeout_keep_alive_task is not None:  # a keep-alive timer would close before the linger ends
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        if not self.transport.is_closing():
            self.transport.write(answer)
            if self.transport.can_write_eof():
                # Closed with the rest of the request unread, the socket would reset the connection and the
                # client might lose the 431: half-close, drop what still comes, and close a moment later.
                self.transport.write_eof()
                self.loop.call_later(LINGER_S, self.transport.close)
            else:
                self.transport.close()

    def _idle(self) -> bool:
        """No request on the connection: none begun, none being answered."""
        if self._in_headers or self._in_body or self._refused or self.pipeline or self.transport.is_closing():
            return False
        return self.cycle is None or self.cycle.response_complete

    # A client that takes nothing of an answer held it, its connection and its place in --max-connections, and the
    # request in flight, for ever (uvicorn's send waits for the buffer to drain, with no deadline; a close waits
    # too: a review's finding). While the transport holds past its high-water mark, or closes with some of an
    # answer unsent, nothing taken for --http-header-timeout (the kernel's buffer counted: connections.unsent) ends
    # the connection; a client that takes its answer, however slowly, is not cut.
    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None and not self.transport.is_closing():  # closing, it waits for the rest
            self._stall.cancel()
            self._stall = None

    def _watch(self) -> None:
        if self._stall is None:
            self._unsent = unsent(self.transport)
            self._stall = self.loop.call_later(self.read_timeout, self._stalled)

    def _stalled(self) -> None:
        self._stall = None
        left = unsent(self.transport)
        if left and left >= self._unsent:
            log.info("closing an HTTP connection that took none of its answer for %g s", self.read_timeout)
            self.transport.abort()
        elif left:  # taken, if slowly
            self._watch()

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()  # a close, which waits for what is unsent
        if unsent(self.transport):
            self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing() and unsent(self.transport):  # closed after its answer: the rest, watched
            self._watch()
        if self._refusal is not None and not self.pipeline and self.cycle is not None and self.cycle.response_complete:
            answer, self._refusal = self._refusal, None
            self._send_refusal(answer)

    def data_received(self, data: bytes) -> None:
        if len(data) <= MAX_HEADER_BYTES:
            self._received(data)
            return
        # A read larger than the limit (256 KiB; one comes when uvicorn resumes reading behind a request) goes
        # to the parser in pieces no larger: headers that begin and end inside one piece are within the limit, and
        # those that span pieces are counted as across reads. Whole, headers begun and ended in it behind another
        # request were counted nowhere (127 KiB answered).
        for at in range(0, len(data), MAX_HEADER_BYTES):
            if self._refused or self.transport.is_closing() or self.transport.get_protocol() is not self:
                return  # refused (the rest dropped, as the next reads will be), answered 400, or upgraded
            self._received(data[at : at + MAX_HEADER_BYTES])

    def _received(self, data: bytes) -> None:
        if self._turned_away is not None:
            self._turn_away(data)
            return
        if self._refused:  # the rest of a refused request is dropped unread
            return
        if self._in_headers:
            # Headers continued from an earlier read end within what is left of the limit, or are refused: a read
            # longer than that is parsed in two, the rest once they have ended (the count after parsing sees only
            # headers still incomplete). A search for their end in the read missed one whose first bytes ("\r",
            # "\r\n", "\r\n\r") ended the read before: a 431 for small headers and a large body.
            left = MAX_HEADER_BYTES - self._header_bytes
            if left <= 0:
                self._count(len(data))
                return
            if len(data) > left:
                self._received(data[:left])
                self._received(data[left:])
                return
        waited = self._chunks if self._chunk_waits else 0  # the size line this read began after, if any
        self._begun_here = False
        super().data_received(data)
        if self._idle() and self.timeout_keep_alive_task is None and self._headers_deadline is None:
            # Bytes that began no request (the empty lines RFC 9112 2.2 lets a client send before one): uvicorn
            # stopped its keep-alive timer for them and armed nothing, and one CRLF after a request held the
            # connection for as long as its client liked (a review's finding). The next request's headers' deadline.
            self._arm()
        # Counted by the chunk, after parsing, while a request's headers are incomplete, rather than by a
        # Python call per header on every request (the hot path of every short request).
        if self._in_headers:
            # The whole read, unless the request began in it behind others pipelined before it (a read of many
            # small ones was counted whole as its headers: a 431 past 64 KiB of them): then from its start.
            self._count(len(data) - (self._start_in(data) if self._begun_here else 0))
        elif waited and self._chunk_waits and self._chunks == waited:
            # the whole read after one chunk's size line, none of its data (the trailer section, after the last);
            # a read that began another request is not, whose headers reset `_chunk_waits`
            self._unfed += len(data)
            if self._unfed > MAX_HEADER_BYTES:  # a trailer field httptools holds whole until it ends
                self._refuse_trailers()

    def _start_in(self, data: bytes) -> int:
        """Where the request whose headers are in progress begins in `data`, the read it began in, or an earlier
        place, never a later one: after the last headers' end in `data` (its own have not ended), its request
        line's first occurrence: its method, one or more spaces (llhttp takes several), its URL so far; before the
        URL, the method's first letter. Behind a body, whose end the bytes do not show, counting from that headers'
        end counted the body as the request's headers (a request pipelined behind a large body refused 431); a
        body that spells the request line or ends in capitals still counts some of itself."""
        end = data.rfind(b"\r\n\r\n")
        after = end + 4 if end >= 0 else 0
        if not self.url:  # the request line not past its method (which reads as DELETE until it is parsed)
            return max(after, len(data.rstrip(b" ").rstrip(METHOD_CHARS)))
        line = re.escape(self.parser.get_method()) + rb" +" + re.escape(self.url)
        found = re.compile(line).search(data, after)
        return found.start() if found is not None else after

    def on_message_begin(self) -> None:
        if self._refused:  # a request pipelined behind the refused one, in the same read: never served
            return
        super().on_message_begin()
        if self.connection_limit is not None:  # a request line's first byte: cut after those that sent nothing
            self.connection_limit.began(self)
        self._header_bytes = 0
        self._in_headers = True
        self._begun_here = True
        self._arm()

    def on_headers_complete(self) -> None:
        if self._refused:  # a request pipelined behind the refused one, in the same read: never served
            return
        # A request's headers whole: never cut for a new connection (connections.py). Not at its first byte, which
        # held a place as cheaply as sending nothing.
        if self.connection_limit is not None:
            self.connection_limit.spoke(self)
        self._disarm()
        self._in_headers = False
        self._in_body = True
        self._chunk_waits = False
        if self.parser.should_upgrade():
            # Upgrade (a WebSocket, h2c: `curl --http2 http://`), which this server never takes (RFC 9110 7.8 lets
            # it decline): the parser reads nothing past these headers, so a body is refused, and a request without
            # one served with its connection closed after it. (uvicorn served an h2c POST with an empty body, the
            # rest of the connection unread, and took a WebSocket upgrade itself: a 403 in plain text, and a place
            # in --max-connections never given back.)
            if any(name == b"transfer-encoding" or (name == b"content-length" and value.strip(b" \t0"))
                   for name, value in self.headers):  # fmt: skip
                self._refused = True
                answer = closing_answer(UPGRADE_WITH_BODY, self.url)
                if self.pipeline or (self.cycle is not None and not self.cycle.response_complete):
                    self._refusal = answer  # after the answers of the requests before it, as a 431 (_count)
                else:
                    self._send_refusal(answer)
                return
            super().on_headers_complete()
            if self.cycle is not None:
                self.cycle.keep_alive = False
            return
        super().on_headers_complete()
        # uvicorn adds a chunked body's trailer fields to the request's headers, with no limit (gigabytes of memory
        # from one request): they go here instead, counted and dropped, as nothing reads them.
        self.headers = self._trailers

    # A chunked body's trailer section is bounded as headers are: the bytes read after a chunk's size line while
    # none of its data has come (after the last chunk's, all of them trailers) may be MAX_HEADER_BYTES, no more.
    def on_chunk_header(self) -> None:
        self._chunk_waits, self._unfed = True, 0
        self._chunks += 1

    def on_chunk_complete(self) -> None:
        self._chunk_waits = False

    def _refuse_trailers(self, size: int = MAX_HEADER_BYTES + 1) -> None:
        """Count `size` bytes of a trailer section; past the limit, the 431, and the request's app, which waits
        for the body's end, told that its client is gone (its body timer would answer 408 on the closing
        connection, as uvicorn's connection_lost tells it once the connection is closed)."""
        self._count(size, TOO_LARGE_TRAILERS)
        if self._refused and self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()

    def on_body(self, body: bytes) -> None:
        if self._refused:  # the rest of a refused request goes nowhere (a 431 in its trailers)
            return
        self._chunk_waits = False
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        if self._refused:  # its 431 is written and the connection closing: the app is not given its end
            return
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        limit = self.connection_limit
        if limit is not None and self._answering:
            self._answering = False
            limit.end_answer()
        if limit is not None and self._admitted:
            self._admitted = False
            limit.release(self)
        if not self._sent_away:
            super().connection_lost(exc)


class HttpServer:
    """An ASGI app served on a socket of its own, on the running event loop."""

    def __init__(
        self,
        app: Any,
        *,
        host: str,
        port: int,
        tls_context: ssl.SSLContext | None = None,
        read_timeout: float,
        reuse_port: bool = False,
        connection_limit: ConnectionLimit | None = None,
    ) -> None:
        protocol = type(
            "Protocol", (ReadTimeoutProtocol,), {"read_timeout": read_timeout, "connection_limit": connection_limit}
        )
        self._protocol = cast(type[ReadTimeoutProtocol], protocol)
        uvicorn_log = logging.getLogger("uvicorn.error")
        if REQUEST_WARNINGS not in uvicorn_log.filters:
            uvicorn_log.addFilter(REQUEST_WARNINGS)
        self.config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=protocol,
            lifespan="off",
            ws="none",  # no WebSocket route: an upgrade is declined (ReadTimeoutProtocol.on_headers_complete)
            log_config=None,
            access_log=False,  # the middleware logs each request, with its id, at debug
            server_header=False,
            proxy_headers=False,
            timeout_keep_alive=KEEP_ALIVE_S,
            backlog=ACCEPT_BATCH,  # the connections asyncio accepts at a time (service/connections.py); see start()
        )
        self.tls_context = tls_context
        self.server = uvicorn.Server(self.config)
        self.read_timeout = read_timeout
        self.host = host
        self.port = port
        self.reuse_port = reuse_port
        self.connection_limit = connection_limit
        self._socket: socket.socket | None = None
        self._ticks: asyncio.Task[None] | None = None

    def bind(self) -> int:
        """Listen (port 0 picks a free one); returns the port. Raises OSError if it cannot."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        # A restarted server may bind while old connections linger in TIME_WAIT; Linux still refuses
        # a port another process listens on.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.reuse_port:  # several server processes on one port (--processes): the kernel spreads connections
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((self.host.strip("[]"), self.port))
        except OSError:
            sock.close()
            raise
        sock.set_inheritable(True)
        self._socket = sock
        self.port = int(sock.getsockname()[1])
        return self.port

    async def start(self) -> None:
        """Serve on the bound socket."""
        assert self._socket is not None, "bind() first"
        if not self.config.loaded:
            self.config.load()
        # uvicorn makes its TLS from files only, as they are by then: the context made from what the server read
        # at start-up instead (service/tls.py), which a process of --processes N started again serves too.
        self.config.ssl = self.tls_context
        self.server.lifespan = self.config.lifespan_class(self.config)
        # The header deadline starts once a connection is made, which with TLS is after the handshake; asyncio
        # gives a handshake 60 s and uvicorn has no setting for it: silent TLS connections held for a
        # minute, not --http-header-timeout. And a connection in its handshake is counted against
        # --max-connections only as service/connections.py's create_server makes it. uvicorn's startup creates
        # the listener: make it there.
        loop = asyncio.get_running_loop()

        async def create_counted_server(
            factory: Callable[[], asyncio.BaseProtocol],
            *,
            sock: socket.socket,
            ssl: ssl.SSLContext | None,
            backlog: int,
        ) -> asyncio.Server:
            del loop.create_server  # the instance attribute: the loop's own method again, which create_server calls
            return await create_server(
                loop,
                factory,
                sock=sock,
                context=ssl,
                handshake_timeout=self.read_timeout,
                limit=self.connection_limit,
                protocol="http",
                answer_refused=True,  # answered 503 once its handshake is done (ReadTimeoutProtocol)
                plaintext=answer_plaintext,
                backlog=backlog,
            )

        loop.create_server = create_counted_server  # type: ignore[method-assign,assignment]
        try:
            await self.server.startup(sockets=[self._socket])
        finally:
            vars(loop).pop("create_server", None)  # should uvicorn not have called it
        bounded_accepts(self._socket, BACKLOG)
        # uvicorn's main loop only refreshes the Date header once a second: run it for that.
        self._ticks = asyncio.get_running_loop().create_task(self.server.main_loop(), name="http-ticks")

    async def stop(self, grace: float) -> None:
        """Stop accepting, let requests in progress finish (at most `grace` seconds), close connections."""
        self.server.should_exit = True
        self.config.timeout_graceful_shutdown = max(1, round(grace))
        if self._ticks is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticks
        if self.server.started:
            if self._socket is not None:
                # the connections accepted before get to uvicorn, which ends them; those accepted from the queue
                # now are answered 503 (ReadTimeoutProtocol.connection_made)
                self._protocol.stopping = True
                if self._protocol.connection_limit is not None:
                    self._protocol.connection_limit.stopping = True  # none cut for those (admit)
                await stop_accepting([self._socket])
            await self.server.shutdown(sockets=[self._socket] if self._socket else None)
        elif self._socket is not None:
            self._socket.close()
