"""Ending idle streams when the server drains, so they do not hold shutdown for the whole grace period.

`server.stop(grace)` waits for every open RPC, and a stream ends only when its handler returns. Two
kinds of stream would never return on their own:
- a client stream waiting for the client's next message (`EncodeStream`, `ModelStreamInfer`, tei.v1's
  `EmbedStream`, `TokenizeStream` and `DecodeStream`, reflection):
  once draining begins, the wait for the next message ends as if the client had half-closed; the
  requests already read are computed and answered in order, then the stream ends with UNAVAILABLE, so
  the client knows that whatever it sent after the last response was not read and goes elsewhere (on the
  lean front, a stream whose client had ended its side, every message read, ends OK: nothing was left
  unanswered; grpc.aio's context cannot say so);
- a subscription (`grpc.health.v1.Health/Watch`): it gets `LAST_WORD` seconds to send NOT_SERVING,
  then ends with UNAVAILABLE.
Unary calls and requests being computed are untouched: they finish within the grace period as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from mhaserve.runtime.errors import Unavailable
from mhaserve.service.rpc.handlers import Behaviour, Continuation, behaviour, kind, rewrap, stream_out
from mhaserve.service.rpc.interceptors import is_exempt

T = TypeVar("T")

SUBSCRIPTIONS = frozenset({"/grpc.health.v1.Health/Watch"})
LAST_WORD = 0.5  # seconds a subscription gets, once draining begins, to send its last status
STREAM_CLOSED = (
    "the server is shutting down: this stream was closed after its last response; "
    "send what was not answered to another replica"
)


class Drain:
    """The moment draining begins, as a future streams can wait on (made on first use, on the server's loop)."""

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None

    def future(self) -> asyncio.Future[None]:
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
        return self._future

    def begin(self) -> None:
        if not self.future().done():
            self.future().set_result(None)

    @property
    def started(self) -> bool:
        return self._future is not None and self._future.done()


async def _next(iterator: AsyncIterator[T]) -> T:
    return await iterator.__anext__()


class _UntilDrain(AsyncIterator[T]):
    """A stream's requests, ending (with `cut` set) when draining begins while waiting for the next one; not cut
    where `ended` says the client had ended its side and every message was read."""

    def __init__(self, iterator: AsyncIterator[T], drain: Drain, ended: Callable[[], bool] | None = None) -> None:
        self._iterator = iterator.__aiter__()
        self._drain = drain
        self._ended = ended
        self.cut = False

    def __aiter__(self) -> _UntilDrain[T]:
        return self

    async def __anext__(self) -> T:
        if self.cut:
            raise StopAsyncIteration
        if not self._drain.started:
            following = asyncio.ensure_future(_next(self._iterator))
            try:
                await asyncio.wait((following, self._drain.future()), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                following.cancel()
                raise
            if following.done():  # a message that arrived wins over the drain
                return following.result()
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await following
        self.cut = self._ended is None or not self._ended()
        raise StopAsyncIteration


class DrainInterceptor(grpc.aio.ServerInterceptor):
    """Wraps client-streaming-and-server-streaming methods and subscriptions as the module docstring says.

    It must come after `ServiceInterceptor` in the server's list (so it wraps the handler directly):
    for the methods that interceptor wraps, the end of a cut stream is raised as Unavailable and
    counted there; for the `exempt` ones (health, reflection) it aborts with UNAVAILABLE itself.
    """

    def __init__(self, drain: Drain, exempt: Sequence[str] = ()) -> None:
        self.drain = drain
        self.exempt = tuple(exempt)

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        counted = not is_exempt(method, self.exempt)
        k = kind(handler)
        # A stream's answers come from an async generator, or from a method that returns one (tei.v1's, which
        # hand the stream to a shared loop): both are wrapped. Only a coroutine, which would write its answers
        # itself, is not (none is served; the wrapper iterates what the method returns).
        if k == "stream_stream" and not inspect.iscoroutinefunction(behaviour(handler)):
            return rewrap(handler, self._client_stream(behaviour(handler), counted))
        if k == "unary_stream" and method in SUBSCRIPTIONS:
            return rewrap(handler, self._subscription(behaviour(handler)))
        return handler

    def _client_stream(self, handle: Behaviour, counted: bool) -> Behaviour:
        drain = self.drain

        async def wrapper(request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            requests = _UntilDrain(request_iterator, drain, getattr(context, "requests_ended", None))
            async for response in handle(requests, context):
                yield response
            if requests.cut:
                if counted:
                    raise Unavailable(STREAM_CLOSED)  # ServiceInterceptor maps and counts it
                await context.abort(grpc.StatusCode.UNAVAILABLE, STREAM_CLOSED)

        return wrapper

    def _subscription(self, handle: Behaviour) -> Behaviour:
        drain = self.drain

        async def wrapper(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            task = asyncio.ensure_future(stream_out(handle, request, context))
            try:
                await asyncio.wait((task, drain.future()), return_when=asyncio.FIRST_COMPLETED)
                if not task.done():
                    await asyncio.wait((task,), timeout=LAST_WORD)
            finally:
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            if not task.cancelled():
                task.result()  # the handler's own end: its status, or its error
                return
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; watch another replica")

        return wrapper
