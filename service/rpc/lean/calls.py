"""One call on the lean gRPC front: the interceptors and the handler, its context, its status.

The handlers are the generic handlers grpc.aio's server would get, and the interceptors grpc.aio's
(`intercept_service`), called the same way: so a call meets the same authentication, bookkeeping, error
map and drain on either front. `Context` is the part of grpc.aio's ServicerContext those use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import grpc
import grpc.aio

from mhaserve.runtime.errors import InvalidArgument, ServiceError, Unimplemented
from mhaserve.service.errors import to_status
from mhaserve.service.rpc.handlers import behaviour, kind, reads_request, stream_out
from mhaserve.service.rpc.lean import frames as f
from mhaserve.service.rpc.lean.connection import NO_MESSAGE, Connection, Stream

log = logging.getLogger(__name__)

Metadata = tuple[tuple[str, str | bytes], ...]


class CallDetails(grpc.HandlerCallDetails):
    """What an interceptor is told of a call: its method and metadata."""

    __slots__ = ("method", "invocation_metadata")

    def __init__(self, method: str, invocation_metadata: Metadata) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


class Context:
    """The call's side of grpc.aio's ServicerContext that our services and interceptors use."""

    __slots__ = ("_connection", "_stream", "serialize", "_code", "_details", "_trailing")

    def __init__(self, connection: Connection, stream: Stream) -> None:
        self._connection = connection
        self._stream = stream
        # The method's response serializer, set by `Calls.serve` once the handler is found.
        self.serialize: Callable[[Any], bytes] = _identity
        self._code = grpc.StatusCode.OK
        self._details = ""
        self._trailing: Metadata = ()

    def time_remaining(self) -> float | None:
        return self._connection.time_remaining(self._stream)

    def invocation_metadata(self) -> Metadata:
        return self._stream.metadata

    def peer(self) -> str:
        return self._connection.peer

    async def send_initial_metadata(self, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        self._connection.set_initial(self._stream, metadata)

    def set_trailing_metadata(self, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        self._trailing = tuple(metadata)

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def set_details(self, details: str) -> None:
        self._details = details

    def details(self) -> str:
        return self._details

    def cancelled(self) -> bool:
        return self._stream.reset or self._stream.expired

    def done(self) -> bool:
        return self._stream.closed

    def requests_ended(self) -> bool:
        """Whether the client has ended its side and every message it sent has been read (not grpc.aio's: a drain
        reads it, rpc/drain.py, to end such a stream OK rather than cut)."""
        stream = self._stream
        return (
            stream.remote_closed
            and not stream.messages
            and not stream.buffer
            and stream.error is None
            and stream.error_after is None
        )

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Iterable[tuple[str, str | bytes]] = ()
    ) -> None:
        if code == grpc.StatusCode.OK:
            raise ValueError("abort() needs a status other than OK")
        self._code, self._details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    async def write(self, message: Any) -> None:
        await self._connection.send(self._stream, self.serialize(message))

    def trailer(self) -> bytes:
        return f.trailer_block(self._code.value[0], self._details, self._trailing)


def _identity(data: Any) -> Any:
    return data


# Counts a call refused while its request was read, before its handler ran: its method (`/pkg.Service/Method`), its
# status and its seconds so far (ServiceInterceptor.refused).
Refused = Callable[[str, grpc.StatusCode, float], None]


class Calls:
    """Serves every call of a connection's streams, through the interceptors, with the handlers; `refused` counts
    the calls refused while their request message is read (a unary call's is read before its handler runs)."""

    def __init__(self, interceptors: Sequence[grpc.aio.ServerInterceptor], refused: Refused | None = None) -> None:
        self.interceptors = tuple(interceptors)
        self.refused = refused
        self.handlers: list[grpc.GenericRpcHandler] = []

    async def _find(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        for handler in self.handlers:
            method = handler.service(details)
            if method is not None:
                return method
        return None

    async def lookup(self, details: grpc.HandlerCallDetails, at: int = 0) -> grpc.RpcMethodHandler | None:
        """The method's handler as the interceptors from `at` on wrap it."""
        if at == len(self.interceptors):
            return await self._find(details)
        return await self.interceptors[at].intercept_service(lambda d: self.lookup(d, at + 1), details)

    async def serve(self, connection: Connection, stream: Stream) -> None:
        began = time.perf_counter()
        context = Context(connection, stream)
        reading = False  # a unary request's message still arriving: no interceptor has seen the call yet
        try:
            handler = await self.lookup(CallDetails(stream.method, stream.metadata))
            if handler is None:
                context.set_code(grpc.StatusCode.UNIMPLEMENTED)
                context.set_details("Method not found!")
                connection.finish(stream, context.trailer())
                return
            k = kind(handler)
            context.serialize = handler.response_serializer or _identity
            deserialize = handler.request_deserializer or _identity
            request: Any
            if not reads_request(handler):
                # A refusal (no key): answered now, where it waited for the whole message, which a client without a
                # key held against --max-incoming-bytes; the answer ends the stream, and what comes of it is dropped.
                request = None
            elif k in ("unary_unary", "unary_stream"):
                reading = True
                request = await self._one(connection, stream, deserialize)
                reading = False
            else:
                request = self._many(connection, stream, deserialize)
            handle = behaviour(handler)
            if k in ("unary_unary", "stream_unary"):
                response = await handle(request, context)
                if self._failed(connection, stream, context):
                    return
                if context.code() == grpc.StatusCode.OK:
                    connection.respond(stream, context.serialize(response), context.trailer())
                else:
                    connection.finish(stream, context.trailer())
                return
            await stream_out(handle, request, context)
            if not self._failed(connection, stream, context):
                connection.finish(stream, context.trailer())
        except grpc.aio.AbortError:
            connection.finish(stream, context.trailer())
        except ServiceError as e:  # reading the request, before any interceptor's error map and count
            code, message = to_status(e)
            if self.refused is not None:  # a method served here (one not found was answered above): a bounded label
                self.refused(stream.method, code, time.perf_counter() - began)
            connection.finish(stream, f.trailer_block(code.value[0], message, context.trailing_metadata()))
        except asyncio.CancelledError:
            if reading and self.refused is not None:  # ended before its message came whole: counted here, as above
                code = grpc.StatusCode.DEADLINE_EXCEEDED if stream.expired else grpc.StatusCode.CANCELLED
                self.refused(stream.method, code, time.perf_counter() - began)
            if stream.expired:
                connection.finish(
                    stream, f.trailer_block(grpc.StatusCode.DEADLINE_EXCEEDED.value[0], "Deadline Exceeded", ())
                )
            else:  # a second request message (answered with its error), or the client reset the stream or left
                self._failed(connection, stream, context)  # (then there is no one to answer: nothing is written)
        except Exception as e:
            log.error("%s failed: %s", stream.method, e, exc_info=e)
            connection.finish(stream, f.trailer_block(grpc.StatusCode.UNKNOWN.value[0], "Unexpected error", ()))
        finally:
            connection.handler_ended(stream)

    @staticmethod
    def _failed(connection: Connection, stream: Stream, context: Context) -> bool:
        """Whether a call that takes one request message was sent another as its handler ran (connection.py's
        `_second_message`, which cancels the handler): then answered here with that error, not the handler's
        answer. Not counted as `refused`: the interceptors counted the handler's end."""
        if not stream.single or stream.error is None:
            return False
        code, message = to_status(stream.error)
        connection.finish(stream, f.trailer_block(code.value[0], message, context.trailing_metadata()))
        return True

    @staticmethod
    async def _one(connection: Connection, stream: Stream, deserialize: Callable[[bytes], Any]) -> Any:
        # Its handler runs without waiting for the client's end of the stream: a second message fails the call,
        # before the handler runs if it came with the first, else as it comes (connection.py's docstring).
        message = await connection.message(stream, only=True)
        if message is None:  # the client ended its side with none: the other cardinality violation, refused alike
            raise Unimplemented(NO_MESSAGE)  # (counted by `refused` under the method, as the client's error)
        return _parse(deserialize, message)

    @staticmethod
    async def _many(connection: Connection, stream: Stream, deserialize: Callable[[bytes], Any]) -> AsyncIterator[Any]:
        while (message := await connection.message(stream)) is not None:
            yield _parse(deserialize, message)


def _parse(deserialize: Callable[[bytes], Any], message: bytes) -> Any:
    try:
        return deserialize(message)
    except Exception as e:  # without ServiceInterceptor, whose deserializers return a malformed message, not raise
        raise InvalidArgument(f"the request is not a valid message for this method: {e}") from None
