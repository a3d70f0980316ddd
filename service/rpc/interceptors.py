"""The one place where gRPC calls meet errors, request ids, readiness and metrics.

`ServiceInterceptor` wraps every method of the model APIs (not the `exempt` ones: health, reflection,
and the Open Inference Protocol's own health methods, which answer while the model loads and drains):
- sets the request id (the client's `x-request-id`, or a new one) in a ContextVar and sends it back;
- refuses calls with UNAVAILABLE while the model loads (after waiting for it up to --loading-wait), while a
  batch stalls (but the `control` methods, the repository API: loading a model again is the remedy) and
  while the server drains;
- turns a raised ServiceError into its status, and anything else into INTERNAL with a short message
  (the stack trace goes to the log with the request id, never to the client);
- refuses a request message that does not parse with INVALID_ARGUMENT, as any other bad input (grpc.aio
  would answer UNKNOWN naming the parser's exception class, log a traceback, and count nothing); the exempt
  methods too, without the rest of this (`_open`);
- counts the call by method and status code, times it, and logs one line per call at debug (`refused`: a call the
  lean gRPC front refused while it read the request, before any of this began).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from mhaserve.runtime.errors import InvalidArgument, ServiceError
from mhaserve.service.context import REQUEST_ID_HEADER, request_id
from mhaserve.service.errors import ABANDONED, DEADLINE_SLACK, to_status
from mhaserve.service.inflight import InFlight
from mhaserve.service.metrics import Metrics
from mhaserve.service.rpc.handlers import (
    Behaviour,
    Continuation,
    behaviour,
    call_request_id,
    kind,
    rewrap,
    stream_out,
    streams_requests,
    streams_responses,
)

log = logging.getLogger(__name__)
# The method label of the calls to a method the server has not.
NO_METHOD = "(no method)"

# The error to refuse a call with, or None to let it in; given the seconds left until the call's deadline
# (None: no deadline), since the answer may wait for a model that is loading (DataPlane.admission).
Gate = Callable[[float | None], Awaitable[ServiceError | None]]


def is_exempt(method: str, exempt: Sequence[str]) -> bool:
    """Whether a full method name (`/pkg.Service/Method`) starts with one of the `exempt` prefixes."""
    return method.startswith(tuple(exempt))


class _Malformed:
    """A request message that did not parse, handed to the call in its place: the call then fails with
    INVALID_ARGUMENT inside its bookkeeping (mapped, counted, logged as a client's error)."""

    __slots__ = ("error",)

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """The method's deserializer, answering a `_Malformed` where it would raise (bytes that are not a
    message of its type, a string field that is not UTF-8)."""
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:
            return _Malformed(InvalidArgument(f"the request is not a valid message for this method: {e}"))

    return parse


def _parsed(request: Any) -> Any:
    if isinstance(request, _Malformed):
        raise request.error
    return request


async def _parsed_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A stream's requests; one that did not parse ends the stream with INVALID_ARGUMENT there."""
    async for request in requests:
        yield _parsed(request)


def _open(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """An exempt method's handler that refuses a message that does not parse with INVALID_ARGUMENT and does
    nothing else: a probe or reflection call is not the model's traffic, and is not counted or gated."""
    handle = behaviour(handler)

    async def check(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request.error))
        return request

    async def check_all(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in requests:
            yield await check(request, context)

    async def unary_in(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await handle(await check(request, context), context)

    async def unary_in_stream_out(request: Any, context: grpc.aio.ServicerContext) -> None:
        await stream_out(handle, await check(request, context), context)

    async def stream_in(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await handle(check_all(requests, context), context)

    async def stream_in_stream_out(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        await stream_out(handle, check_all(requests, context), context)

    new = {
        "unary_unary": unary_in,
        "unary_stream": unary_in_stream_out,
        "stream_unary": stream_in,
        "stream_stream": stream_in_stream_out,
    }[kind(handler)]
    return rewrap(handler, new, request_deserializer=_tolerant(handler.request_deserializer))


class _Call:
    """The bookkeeping of one RPC: request id, gate, error map, metrics, log line."""

    def __init__(
        self, interceptor: ServiceInterceptor, method: str, rid: str, context: grpc.aio.ServicerContext, gate: Gate
    ) -> None:
        self.interceptor = interceptor
        self.gate = gate
        self.method = method
        self.rid = rid
        self.context = context
        self.code = grpc.StatusCode.OK
        self.start = time.perf_counter()
        self.task = asyncio.current_task()
        self.abandoned: ServiceError | None = None  # what to answer once `abandon` has cancelled the call

    async def begin(self) -> None:
        request_id.set(self.rid)  # each RPC runs in its own task, hence its own context
        self.interceptor.metrics.in_flight.inc()
        self.interceptor.in_flight.begin()
        self.interceptor.calls.add(self)
        self.context.set_trailing_metadata(((REQUEST_ID_HEADER, self.rid),))
        refusal = await self.gate(self.context.time_remaining())
        if refusal is not None:
            raise refusal

    async def fail(self, error: Exception) -> None:
        code, message = to_status(error, self.rid)
        if code == grpc.StatusCode.INTERNAL:
            # A ServiceError was logged where it arose; anything else is a bug and needs its traceback.
            log.error(
                "%s failed: %s",
                self.method,
                to_status(error)[1],
                exc_info=None if isinstance(error, ServiceError) else error,
            )
        self.code = code
        # abort, before any answer: a trailers-only response, which a client's retry policy may retry. Setting the
        # code and returning is 60-100 us cheaper a refusal, but grpc.aio then sends response headers first, and
        # clients may no longer retry (test_server.py, the retry policy's test).
        await self.context.abort(code, message, trailing_metadata=((REQUEST_ID_HEADER, self.rid),))

    async def cancelled(self) -> None:
        """The call's task was cancelled: by its client (counted CANCELLED, or DEADLINE_EXCEEDED), or by the
        server at the end of its grace period (`abandon`: answered with the error it was given)."""
        if self.abandoned is not None and (task := asyncio.current_task()) is not None:
            task.uncancel()
            await self.fail(self.abandoned)  # raises AbortError: answered, not cancelled
        self.gone()

    def gone(self) -> None:
        """Its client is gone: counted CANCELLED, or DEADLINE_EXCEEDED where the deadline passed; or the server's
        grace period ended while it wrote an answer (`abandon`), which cancelled it there: counted with the
        abandon's code (UNAVAILABLE), which its client sees too, from its connection's end."""
        if self.abandoned is not None:
            self.code = to_status(self.abandoned, self.rid)[0]
            return
        remaining = self.context.time_remaining()
        # The client's deadline fires first and cancels the call (DEADLINE_SLACK says how close counts).
        expired = remaining is not None and remaining <= DEADLINE_SLACK
        self.code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED

    def end(self) -> None:
        m = self.interceptor.metrics
        elapsed = time.perf_counter() - self.start
        # Counted before it leaves the in-flight gauge: a scrape never sees a call that is neither.
        m.requests.labels(self.method, self.code.name).inc()
        m.request_duration.labels(self.method).observe(elapsed)
        m.in_flight.dec()
        self.interceptor.in_flight.end()
        self.interceptor.calls.discard(self)
        log.debug("%s %s %.1f ms", self.method, self.code.name, elapsed * 1000)


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    """See the module docstring. `gate` returns the error to refuse calls with, or None to let them in;
    `control_gate` does for the `control` methods."""

    def __init__(
        self,
        metrics: Metrics,
        gate: Gate,
        exempt: Sequence[str] = (),
        in_flight: InFlight | None = None,
        *,
        control: Sequence[str] = (),
        control_gate: Gate | None = None,
    ) -> None:
        self.metrics = metrics
        self.gate = gate
        self.control = tuple(control)
        self.control_gate = control_gate or gate
        self.exempt = tuple(exempt)
        self.in_flight = in_flight or InFlight()  # shared with the HTTP server: the drain waits on both
        self.calls: set[_Call] = set()  # the calls begun and not yet ended

    def refused(self, full: str, code: grpc.StatusCode, elapsed: float) -> None:
        """Count a call the lean gRPC front refused while it read its request, before the call's handler (and so this
        bookkeeping) began: a message over --max-message-bytes, past --max-incoming-bytes, incomplete or too slow to
        arrive, or followed by a second, or missing, where the method takes one. HTTP counts its 413, 429, 400 and 408
        under the route asked for; this counts the call so under its method (grpc.aio's front refuses the first four
        inside grpc core, where no interceptor sees them; a second message it drops, answering from the first, and a
        call with none it leaves unanswered until its deadline)."""
        if is_exempt(full, self.exempt):
            return
        method = full.lstrip("/")
        self.metrics.requests.labels(method, code.name).inc()
        self.metrics.request_duration.labels(method).observe(elapsed)
        log.debug("%s %s %.1f ms", method, code.name, elapsed * 1000)

    def abandon(self, error: ServiceError) -> list[asyncio.Task[Any]]:
        """Answer every call still running with `error` (the server's grace period is over: UNAVAILABLE, which
        clients retry, rather than the CANCELLED grpc's own stop would count); their tasks, to wait for."""
        tasks = []
        for call in self.calls:
            if call.task is not None and not call.task.done():
                call.abandoned = error
                call.task.cancel(ABANDONED)
                tasks.append(call.task)
        return tasks

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        full = handler_call_details.method
        if handler is None:
            # A method no service here has: UNIMPLEMENTED, from the front. Counted under one label, as the HTTP
            # port counts requests for no route (the method's own would be a series of each name a client makes).
            self.metrics.requests.labels(NO_METHOD, grpc.StatusCode.UNIMPLEMENTED.name).inc()
            log.debug("UNIMPLEMENTED: no method %r here", full[:200])
            return None
        if is_exempt(full, self.exempt):
            return _open(handler)
        method = full.lstrip("/")
        rid = call_request_id(handler_call_details)
        wrap = self._stream if streams_responses(handler) else self._unary
        parsed = _parsed_stream if streams_requests(handler) else _parsed
        gate = self.control_gate if is_exempt(full, self.control) else self.gate
        return rewrap(
            handler,
            wrap(behaviour(handler), method, rid, parsed, gate),
            request_deserializer=_tolerant(handler.request_deserializer),
        )

    def _unary(self, handle: Behaviour, method: str, rid: str, parsed: Callable[[Any], Any], gate: Gate) -> Behaviour:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = _Call(self, method, rid, context, gate)
            try:
                await call.begin()
                return await handle(parsed(request), context)
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError:
                await call.cancelled()
                raise
            except Exception as e:
                await call.fail(e)
            finally:
                call.end()

        return wrapper

    def _stream(self, handle: Behaviour, method: str, rid: str, parsed: Callable[[Any], Any], gate: Gate) -> Behaviour:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call = _Call(self, method, rid, context, gate)
            try:
                await call.begin()
                async for response in handle(parsed(request), context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError:
                await call.cancelled()
                raise
            except GeneratorExit:
                # Closed at a `yield` by what wrote its answers: a client that cancelled, or whose deadline passed,
                # while an answer was being written has that raised in the writer, not here (it was counted OK).
                call.gone()
                raise
            except Exception as e:
                await call.fail(e)
            finally:
                call.end()

        return wrapper
