"""The one place where HTTP requests meet request ids, API keys, readiness, limits, cancellation and metrics.

The HTTP counterpart of the gRPC interceptors (service/rpc/), in front of every route:
- the request id: the client's `x-request-id`, or a new one, in the log context and sent back;
- API keys: `Authorization: Bearer <key>`, before anything else (health probes and the API's own
  description are open, as health checks and reflection are on the gRPC port);
- readiness: while the model loads (after waiting for it up to --loading-wait), stalls or the server
  drains, 503 with Retry-After (health routes answer regardless, saying so; the repository API, under
  `admin_prefix`, answers while a model stalls: loading it again is the remedy); a request refused at once
  is refused unread, and one that waits has its body read first and waits where a client that leaves is seen;
- the body, read whole before any route sees it: over the size limit, 413 (at once when its
  Content-Length says so); slower than the read timeout, 408; gzip or deflate, inflated within the limit;
  while it arrives, counted against the process's --max-incoming-bytes (incoming.py), past which 429; the open
  routes take none: a body sent to them is left unread, uncounted, and the connection closed after the answer;
- a client that disconnects cancels its request, which then gives its queue slots back, as a cancelled
  gRPC call does;
- the same request counters and histograms as gRPC (`mhaserve_requests_total{method="POST /v1/embeddings",
  code="OK"}`: the code in gRPC's vocabulary, from the same error map), and one log line at debug; health
  probes and the docs are not counted, as gRPC's health and reflection are not.

Fast routes (`POST /v1/embeddings`) are answered here, past the framework: skipping FastAPI's and
Starlette's layers cut the event loop's CPU per one-text request by 28 % (1.23 to 0.89 ms at 32 clients,
docs/benchmarks.md), and the event loop is what bounds one-text requests on a GPU (docs/gpu.md). The
framework keeps the route for its OpenAPI document; both run the same handler.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mhaserve.runtime.errors import (
    PermissionDenied,
    RequestTimeout,
    ServiceError,
    TooLarge,
    Unavailable,
    UnsupportedMediaType,
)
from mhaserve.runtime.manifest import MAX_VERSION, number
from mhaserve.service.auth import Keys, bearer, refusal_lines
from mhaserve.service.context import REQUEST_ID_HEADER, accept_request_id, request_id
from mhaserve.service.errors import ABANDONED
from mhaserve.service.http.bodies import Chunked, Reply
from mhaserve.service.http.errors import CODE_KEY, render
from mhaserve.service.incoming import Incoming, default_limit
from mhaserve.service.inflate import KINDS, inflate
from mhaserve.service.inflight import InFlight
from mhaserve.service.metrics import Metrics

log = logging.getLogger(__name__)
REFUSALS = refusal_lines()
log.addFilter(REFUSALS)

# The error to refuse a request with, or None; given the seconds it may wait (None: no deadline of its own),
# since the answer may wait for a model that is loading (DataPlane.admission).
Gate = Callable[[float | None], Awaitable[ServiceError | None]]


def has_body(scope: Scope) -> bool:
    """Whether a request announces a body (a length above 0, or chunks)."""
    length = header(scope, b"content-length")
    return header(scope, b"transfer-encoding") is not None or (length is not None and length.strip() not in ("", "0"))


def loggable(path: str) -> str:
    """A request's path as it may go into a log line: percent-decoded, it may hold a newline (a forged log
    line, before any key is checked) or a terminal's escape codes; such a path is logged escaped."""
    return path if path.isprintable() else ascii(path)


# A body over the limit is read and dropped up to this size before the 413, so the client sees the answer.
DRAIN_BYTES = 64 << 20
UNREAD_KEY = "mhaserve.unread"  # the scope key set when a request's body was left unread


@dataclass(frozen=True)
class FastRoute:
    """A route this middleware answers itself: `handler` takes the body and its Content-Type and returns the
    JSON response body (with headers of its own: Reply; or a body in chunks, of its own media type), or raises
    a ServiceError. It stands in the scope as the route (`_count` names the metrics by its `path`, as by a
    framework route's)."""

    path: str
    handler: Callable[[bytes, str | None], Awaitable[bytes | Reply | Chunked]]


async def _gone(receive: Receive) -> Message:
    """The message that says the client went away, once the body is read; what still comes of a body left unread
    (UNREAD_KEY) is dropped meanwhile."""
    while (message := await receive())["type"] != "http.disconnect":
        pass
    return message


class _ClientGone(Exception):
    """The client disconnected before it had sent its whole request."""


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


class CallMiddleware:
    """See the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: Metrics,
        in_flight: InFlight,
        gate: Gate,
        hold: Callable[[], float],
        keys: Keys,
        max_body_bytes: int,
        read_timeout: float,
        open_gets: Sequence[str],
        always_answered: Callable[[str, str], bool],
        admin_prefix: str = "",
        fast_routes: Mapping[tuple[str, str], FastRoute] | None = None,
        route_of: Callable[[Scope], str | None] = lambda scope: None,
        control_gate: Gate | None = None,
        incoming: Incoming | None = None,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.in_flight = in_flight
        self.gate = gate
        self.control_gate = control_gate or gate  # the repository API's (under admin_prefix)
        self.hold = hold  # the seconds the gates would wait for a model that loads (DataPlane.hold), 0: none
        self.keys = keys
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        # Bodies still arriving count against the process's limit, with the lean gRPC front's messages
        self.incoming = incoming or Incoming(default_limit(max_body_bytes))
        self.open_gets = frozenset(open_gets)  # paths a GET (or HEAD) of needs no API key
        self.always_answered = always_answered
        self.admin_prefix = admin_prefix
        self.fast_routes = dict(fast_routes or {})  # (method, path) -> FastRoute
        # The route template a request's path and method would reach: the metrics' label for a request
        # refused before it reached its route (API key, loading or draining, body limits).
        self.route_of = route_of
        self.running: set[asyncio.Task[Any]] = set()  # requests reading their body or running, for `abandon`

    def abandon(self) -> list[asyncio.Task[Any]]:
        """Answer every request still running 503 (the server's grace period is over), as the gRPC calls are
        answered UNAVAILABLE at that moment: left to uvicorn, they waited out its own graceful-shutdown
        timeout (a second or more past the grace period) and were cancelled with an ERROR log line. Their
        tasks, to wait for."""
        tasks = [task for task in self.running if not task.done()]
        for task in tasks:
            task.cancel(ABANDONED)
        return tasks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        rid = accept_request_id(header(scope, REQUEST_ID_HEADER.encode()))
        request_id.set(rid)
        path: str = scope["path"]
        response: dict[str, Any] = {"status": 0, "complete": False}
        # HEAD is GET's answer without its body (RFC 9110 9.3.2; uptime monitors and some balancers' checks
        # send it), where GET has a route; FastAPI's routes take only the methods they name.
        head = scope["method"] == "HEAD" and self.route_of({**scope, "method": "GET"}) is not None
        if head:
            scope = {**scope, "method": "GET"}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                response["status"] = message["status"]
                message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER.encode(), rid.encode())]
                if scope.get(UNREAD_KEY):  # the client may still be sending its body: do not read on
                    message["headers"].append((b"connection", b"close"))
            elif message["type"] == "http.response.body":
                if head:
                    message = {**message, "body": b""}
                if not message.get("more_body", False):
                    response["complete"] = True
            await send(message)

        # Health probes and the docs are not counted, as gRPC's health and reflection are not: a probe's
        # "not ready" (503, or KServe's 400) is an answer, not a failed request, and a balancer's probes
        # every 250 ms would otherwise fill the request rate and, counted UNKNOWN, the server-error alert.
        # Nor are they in flight: the drain does not wait on them, nor does the gauge show them.
        counted = not self.always_answered(scope["method"], path)
        refused = False
        if counted:
            self.in_flight.begin()
            self.metrics.in_flight.inc()
        try:
            admin = bool(self.admin_prefix) and path.startswith(self.admin_prefix)
            refusal = self._key_refusal(scope, path, admin)
            gate = (self.control_gate if admin else self.gate) if counted and refusal is None else None
            # A request the gate would hold for a model that loads (--loading-wait) has its body read first and waits
            # in `_run`, whose watcher sees its client leave (that news comes after the body, so nothing here would
            # see it); the others meet the gate here, and one refused is refused unread.
            if gate is not None and not self.hold():
                refusal, gate = await gate(None), None
            if refusal is not None:
                refused = True
                if has_body(scope):
                    # Refused unread: the connection closes after the answer, or a client without a key could
                    # trickle that body for as long as it likes (the read timeout guards only bodies read).
                    scope[UNREAD_KEY] = True
                await self._error(refusal, scope, rid, send_with_id)
            else:
                try:
                    body = await self._read(scope, path, receive)
                except ServiceError as e:
                    await self._error(e, scope, rid, send_with_id)
                except _ClientGone:
                    scope[CODE_KEY] = "CANCELLED"
                else:
                    await self._run(scope, body, receive, send_with_id, response, rid, gate)
        finally:
            if counted:
                self.in_flight.end()
                self.metrics.in_flight.dec()
            if counted or refused:  # a probe refused for want of a key is counted, as gRPC's auth counts it
                self._count(scope, response["status"], time.perf_counter() - started)

    def _key_refusal(self, scope: Scope, path: str, admin: bool) -> ServiceError | None:
        if self.keys.enabled and (admin or not (scope["method"] in ("GET", "HEAD") and path in self.open_gets)):
            token, reason = bearer([("authorization", v) for k, v in scope["headers"] if k == b"authorization"])
            refusal = self.keys.refusal(token, admin=admin)
            if refusal is not None:
                why = reason if token is None else refusal.message
                # "denied": a client key on an admin route, each line kept (the throttle takes "refused")
                line = "denied %s %s: %s" if isinstance(refusal, PermissionDenied) else "refused %s %s: %s"
                log.info(line, scope["method"], loggable(path), why)
                return refusal
        return None

    def _reads_body(self, scope: Scope, path: str) -> bool:
        """Whether the request's body is read: not for the open routes (probes, the API's description), which take
        none, where a client without a key would hold the process's --max-incoming-bytes with bodies it trickles
        or never finishes, as the routes needing a key refuse it unread; a body announced is left unread."""
        if not (scope["method"] in ("GET", "HEAD") and path in self.open_gets):
            return True
        if has_body(scope):
            scope[UNREAD_KEY] = True
        return False

    async def _read(self, scope: Scope, path: str, receive: Receive) -> bytes:
        """The body, if the route reads one; a body still arriving when the grace period ends (`abandon`) is
        UNAVAILABLE, as a request running then is: left to uvicorn it was cancelled a second later, a plain-text
        500 with a traceback, holding the process's exit past its grace."""
        if not self._reads_body(scope, path):
            return b""
        this = asyncio.current_task()
        assert this is not None
        self.running.add(this)
        try:
            return await self._body(scope, receive)
        except asyncio.CancelledError:
            this.uncancel()
            scope[UNREAD_KEY] = True  # the rest of it is not read: the connection closes after the answer
            raise Unavailable(
                "the server stopped before this request's body had arrived (its grace period ended); retry"
            ) from None
        finally:
            self.running.discard(this)

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        """The whole request body, within the size limit and the read timeout.

        A body over the limit is still read (and dropped) up to DRAIN_BYTES, so that the client, which
        is usually still sending, reads the 413 instead of a connection reset; a larger one is refused
        at once and the connection closed (UNREAD_KEY tells `_error`).
        """
        length = header(scope, b"content-length")
        declared = None if length is None else number(length)
        if declared is not None and declared > max(self.max_body_bytes, DRAIN_BYTES):
            scope[UNREAD_KEY] = True
            # past 19 digits number() reads MAX_VERSION + 1, not the length: say at least that
            raise TooLarge(self._too_large(min(declared, MAX_VERSION + 1), at_least=declared > MAX_VERSION))
        chunks: list[bytes] = []
        size = 0
        incoming = self.incoming
        held = 0  # counted in `incoming` until the body is complete

        async def read() -> None:
            nonlocal size, held
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                more = message.get("more_body", False)
                if size <= self.max_body_bytes:
                    if not incoming.admits(len(chunk)):
                        if more:
                            scope[UNREAD_KEY] = True
                        raise incoming.refusal()
                    incoming.held += len(chunk)
                    held += len(chunk)
                    chunks.append(chunk)
                elif size > DRAIN_BYTES and more:
                    scope[UNREAD_KEY] = True
                    return

        try:
            async with asyncio.timeout(self.read_timeout):  # in this task: wait_for would start one per request
                await read()
        except TimeoutError:
            scope[UNREAD_KEY] = True
            raise RequestTimeout(f"the request body took more than {self.read_timeout:g} s to arrive") from None
        finally:
            incoming.held -= held
        if size > self.max_body_bytes:
            raise TooLarge(self._too_large(size, at_least=declared is None))
        return self._decode(b"".join(chunks), header(scope, b"content-encoding"))

    def _decode(self, body: bytes, encoding: str | None) -> bytes:
        """A gzip or deflate body (tritonclient can send them), inflated within the size limit."""
        if encoding is None or encoding.strip().lower() in ("", "identity"):
            return body
        kind = encoding.strip().lower()
        kind = "gzip" if kind == "x-gzip" else kind  # a recipient should read it as gzip (RFC 9110, 8.4.1.3)
        if kind not in KINDS:
            raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not supported (gzip, deflate or none)")
        out = inflate(body, kind, self.max_body_bytes, f"the {kind} body")
        if len(out) > self.max_body_bytes:
            raise TooLarge(self._too_large(len(out), at_least=True, inflated=True))
        return out

    def _too_large(self, size: int, at_least: bool = False, inflated: bool = False) -> str:
        return (
            f"the request body is {'at least ' if at_least else ''}{size} bytes{' once inflated' if inflated else ''};"
            f" the limit is {self.max_body_bytes} (--max-message-bytes): split the request"
        )

    async def _run(
        self,
        scope: Scope,
        body: bytes,
        receive: Receive,
        send: Send,
        response: dict[str, Any],
        rid: str,
        gate: Gate | None,
    ) -> None:
        """Run the app on the body read, once `gate` (if any: it holds the request for a model that loads) has
        admitted it; if the client disconnects before the answer is sent, cancel it.

        The app runs in this task, and a watcher of the connection cancels this task if the client leaves:
        a task of its own for the app, and a wait on both, cost two more turns of the event loop on every
        request's path.
        """
        disconnected = asyncio.ensure_future(_gone(receive))
        sent_body = False
        this = asyncio.current_task()
        assert this is not None
        running = True
        left = False
        self.running.add(this)

        def on_disconnect(_: asyncio.Future[Message]) -> None:
            nonlocal left
            if running and not response["complete"] and not disconnected.cancelled():
                left = True
                this.cancel()  # the client left: free what the request holds (queue slots, its batch row)

        disconnected.add_done_callback(on_disconnect)

        async def replay() -> Message:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await asyncio.shield(disconnected)

        fast = self.fast_routes.get((scope["method"], scope["path"]))
        try:
            refusal = None if gate is None else await gate(None)
            if refusal is not None:
                await self._error(refusal, scope, rid, send)
            else:
                await (self.app(scope, replay, send) if fast is None else self._fast(fast, scope, body, send, rid))
        except asyncio.CancelledError:
            if not left:  # the server is stopping (its grace period is over), not the client
                if response["status"]:
                    raise
                # Answered UNAVAILABLE, as gRPC's calls are then: left to uvicorn, the cancellation was a 500
                # (an engine failure or a bug, by the error map) with a traceback in the log.
                this.uncancel()
                running = False
                await self._error(
                    Unavailable("the server stopped before this request was answered (its grace period ended); retry"),
                    scope,
                    rid,
                    send,
                )
                return
            this.uncancel()
            scope[CODE_KEY] = "CANCELLED"
        except Exception as e:  # the app's own error handlers send every error; this is a bug past them
            running = False  # the answer below is not cancelled
            if response["status"]:
                # Starlette raises again what its error handler answered, which logged it (app.py): once is enough.
                log.debug("%s %s failed after answering", scope["method"], loggable(scope["path"]), exc_info=e)
                return
            log.error("%s %s failed", scope["method"], loggable(scope["path"]), exc_info=e)
            await self._error(e, scope, rid, send)
        finally:
            running = False
            disconnected.cancel()
            self.running.discard(this)

    async def _fast(self, fast: FastRoute, scope: Scope, body: bytes, send: Send, rid: str) -> None:
        """A fast route's answer: its handler's JSON, or its error through the one error map (anything but a
        ServiceError is a bug, which `_run` logs and answers as the framework's handler would)."""
        scope["route"] = fast
        try:
            out = await fast.handler(body, header(scope, b"content-type"))
        except ServiceError as e:
            await self._error(e, scope, rid, send)
            return
        if isinstance(out, Chunked):  # no length: HTTP/1.1 sends it chunked
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", out.media_type.encode())]}
            )
            async for chunk in out.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        body, extra = (out.body, out.headers) if isinstance(out, Reply) else (out, ())
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _error(self, error: BaseException, scope: Scope, rid: str, send: Send) -> None:
        status, headers, body = render(error, scope["path"], rid, scope)
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _count(self, scope: Scope, status: int, elapsed: float) -> None:
        route = scope.get("route")
        path = route.path if route is not None else self.route_of(scope)
        method = f"{scope['method']} {path or '(no route)'}"
        # Every error answer passes the error map (errors.render), which leaves its status name in the scope.
        code = scope.get(CODE_KEY) or ("OK" if 200 <= status < 400 else "UNKNOWN")
        self.metrics.requests.labels(method, code).inc()
        self.metrics.request_duration.labels(method).observe(elapsed)
        if log.isEnabledFor(logging.DEBUG):  # every request passes here: escape its path only for a line written
            log.debug("%s %s %d %s %.1f ms", scope["method"], loggable(scope["path"]), status, code, elapsed * 1000)
