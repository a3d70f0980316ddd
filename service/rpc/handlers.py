"""Rewrapping a gRPC method handler: the one place that knows grpc's four kinds of handler.

Interceptors (the call bookkeeping, authentication, the drain) each replace a handler's behaviour with
a wrapper of their own and must build a handler of the same kind with the same codec. A unary-response
kind (unary-unary, stream-unary) wraps a coroutine; a streaming-response kind (unary-stream,
stream-stream) wraps an async generator.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import grpc

from mhaserve.service.context import REQUEST_ID_HEADER, accept_request_id

Kind = Literal["unary_unary", "stream_unary", "unary_stream", "stream_stream"]
KINDS: tuple[Kind, ...] = ("unary_unary", "stream_unary", "unary_stream", "stream_stream")
Behaviour = Callable[..., Any]
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]

_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def call_request_id(details: grpc.HandlerCallDetails) -> str:
    """The call's request id: the client's `x-request-id` metadata if it is a sane one, else a new one."""
    sent = next((v for k, v in details.invocation_metadata or () if k == REQUEST_ID_HEADER), None)
    return accept_request_id(sent)


def kind(handler: grpc.RpcMethodHandler) -> Kind:
    """Which of the four kinds a handler is."""
    for k in KINDS:
        if getattr(handler, k) is not None:
            return k
    raise ValueError(f"a method handler with no behaviour: {handler!r}")


def streams_requests(handler: grpc.RpcMethodHandler) -> bool:
    """Whether the handler reads a stream of requests (an async iterator) rather than one message."""
    return kind(handler) in ("stream_unary", "stream_stream")


def streams_responses(handler: grpc.RpcMethodHandler) -> bool:
    """Whether the handler answers with a stream (an async generator) rather than one message."""
    return kind(handler) in ("unary_stream", "stream_stream")


def behaviour(handler: grpc.RpcMethodHandler) -> Behaviour:
    """The function that handles the call."""
    return getattr(handler, kind(handler))


def answers_unread(new: Behaviour) -> Behaviour:
    """`new`, marked as answering without its request (a refusal): the lean front runs it as the call comes, where
    it waits for a unary call's message whole first, and lets the request go unread (rpc/lean/calls.py)."""
    new.reads_request = False  # type: ignore[attr-defined]
    return new


def reads_request(handler: grpc.RpcMethodHandler) -> bool:
    """Whether the handler's behaviour reads the call's request (all but those marked by `answers_unread`)."""
    return getattr(behaviour(handler), "reads_request", True)


async def stream_out(handle: Behaviour, request: Any, context: Any) -> None:
    """Run a streaming-response behaviour to its end: an async generator's responses written to the call one by
    one, or a coroutine that writes them itself (`context.write`), as the health servicer's Watch does."""
    result = handle(request, context)
    if inspect.isasyncgen(result):
        async for response in result:
            await context.write(response)
    else:
        await result


def rewrap(
    handler: grpc.RpcMethodHandler, new: Behaviour, *, request_deserializer: Callable[[bytes], Any] | None = None
) -> grpc.RpcMethodHandler:
    """A handler of the same kind and codec as `handler` (or another request deserializer), whose behaviour
    is `new`."""
    return _FACTORIES[kind(handler)](
        new,
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
