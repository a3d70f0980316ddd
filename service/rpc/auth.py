"""API keys on the gRPC port: every call to a method that is not open needs `authorization: Bearer <key>`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from mhaserve.runtime.errors import PermissionDenied
from mhaserve.service.auth import Keys, bearer, is_open, refusal_lines
from mhaserve.service.context import REQUEST_ID_HEADER, request_id
from mhaserve.service.errors import to_status
from mhaserve.service.metrics import Metrics
from mhaserve.service.rpc.handlers import (
    Continuation,
    answers_unread,
    call_request_id,
    rewrap,
    streams_responses,
)

log = logging.getLogger(__name__)
REFUSALS = refusal_lines()
log.addFilter(REFUSALS)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call to a method not in `open_methods` that lacks a valid key, with UNAUTHENTICATED, and a
    call to an `admin_methods` one without an admin key with PERMISSION_DENIED (auth.Keys).

    It runs first, so a refused call never reaches the readiness gate or the handler, and the lean front answers it
    without reading its request (handlers.answers_unread); it is counted in
    `mhaserve_requests_total{code=...}` here, and logged with its request id, which goes back to the client.
    """

    def __init__(
        self, keys: Keys, open_methods: Sequence[str], metrics: Metrics, admin_methods: Sequence[str] = ()
    ) -> None:
        self.keys = keys
        self.open_methods = tuple(open_methods)
        self.admin_methods = frozenset(admin_methods)
        self.metrics = metrics

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        admin = method in self.admin_methods
        if is_open(method, self.open_methods) and not admin:
            return await continuation(handler_call_details)
        token, reason = bearer(handler_call_details.invocation_metadata)
        refusal = self.keys.refusal(token, admin=admin)
        if refusal is None:
            return await continuation(handler_call_details)
        start = time.perf_counter()  # a refusal is timed from here: the calls let in pay nothing for it
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # UNIMPLEMENTED, as for anyone
        code, message = to_status(refusal)
        # The request id the call would have had (the client's, or a new one), in the log line and sent back,
        # as the HTTP port does: a client's refused call can be found in the log.
        rid = call_request_id(handler_call_details)
        request_id.set(rid)
        # "denied": a client key on an admin method, each line kept (the throttle takes "refused", no valid key)
        line = "denied %s: %s" if isinstance(refusal, PermissionDenied) else "refused %s: %s"
        log.info(line, method, reason if token is None else message)
        self.metrics.requests.labels(method.lstrip("/"), code.name).inc()
        # Observed as every answered call is, so that the histogram's _count and the counter agree.
        duration = self.metrics.request_duration.labels(method.lstrip("/"))

        def observe() -> None:
            duration.observe(time.perf_counter() - start)

        return rewrap(handler, _refusal(code, message, rid, observe, streaming=streams_responses(handler)))


def _refusal(code: grpc.StatusCode, message: str, rid: str, observe: Callable[[], None], *, streaming: bool) -> Any:
    """A handler that answers `code` without reading the request."""
    trailer = ((REQUEST_ID_HEADER, rid),)

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        observe()
        await context.abort(code, message, trailing_metadata=trailer)

    async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        observe()
        await context.abort(code, message, trailing_metadata=trailer)
        yield  # an async generator, as streaming handlers are

    return answers_unread(stream if streaming else unary)
