"""API keys on the gRPC port: every call to a method that is not open needs `authorization: Bearer <key>`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc
import grpc.aio

from mhaserve.service.auth import MESSAGE, KeyRing, bearer, is_open
from mhaserve.service.metrics import Metrics
from mhaserve.service.rpc.handlers import Continuation, rewrap, streams_responses

log = logging.getLogger(__name__)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call to a method not in `open_methods` that lacks a valid key, with UNAUTHENTICATED.

    It runs first, so a refused call never reaches the readiness gate, the request id or the handler;
    it is counted in `mhaserve_requests_total{code="UNAUTHENTICATED"}` here.
    """

    MESSAGE = MESSAGE

    def __init__(self, keys: KeyRing, open_methods: Sequence[str], metrics: Metrics) -> None:
        self.keys = keys
        self.open_methods = tuple(open_methods)
        self.metrics = metrics

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if is_open(method, self.open_methods):
            return await continuation(handler_call_details)
        token, reason = bearer(handler_call_details.invocation_metadata)
        if token is not None and self.keys.accepts(token):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # UNIMPLEMENTED, as for anyone
        log.info("refused %s: %s", method, reason)
        self.metrics.requests.labels(method.lstrip("/"), grpc.StatusCode.UNAUTHENTICATED.name).inc()
        return rewrap(handler, _streaming_refusal if streams_responses(handler) else _refusal)


async def _refusal(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    """Answers UNAUTHENTICATED without reading the request."""
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)


async def _streaming_refusal(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)
    yield  # an async generator, as streaming handlers are
