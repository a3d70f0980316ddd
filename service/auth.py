"""API-key authentication: `authorization: Bearer <key>` metadata, checked before any handler runs.

Keys come from `--api-keys-file` (one per line) and `MHASERVE_API_KEYS` (comma-separated). Only their
sha256 digests are kept; a presented key is hashed and compared with `hmac.compare_digest` against
every digest, without stopping at a match, so neither the time taken nor the log says which key, or
how much of one, was right. Keys never reach a log line or an error message. Methods listed in
`--open-methods` (health checks and reflection by default) need no key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
SCHEME = "bearer"
# Characters gRPC metadata values may hold; a key outside them could never be sent.
_PRINTABLE_ASCII = frozenset(chr(c) for c in range(0x21, 0x7F))

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class AuthError(ValueError):
    """The API keys cannot be read or are malformed; the message names the file and line, never the key."""


def _check_key(key: str, where: str) -> str:
    if not set(key) <= _PRINTABLE_ASCII:
        raise AuthError(f"{where}: an API key must be printable ASCII without spaces (gRPC metadata carries it)")
    return key


def read_keys_file(path: Path) -> list[str]:
    """The keys of a file: one per line, surrounding blanks stripped, blank lines and `#` comments skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise AuthError(f"cannot read --api-keys-file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise AuthError(f"--api-keys-file {path} is not UTF-8 text") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(_check_key(line, f"{path} line {number}"))
    if not keys:
        raise AuthError(f"--api-keys-file {path} holds no key (one per line; '#' starts a comment)")
    return keys


def load_keys(settings: Settings) -> list[str]:
    """Every configured key, file first; empty when authentication is off."""
    keys = read_keys_file(settings.api_keys_file) if settings.api_keys_file is not None else []
    keys += [_check_key(k, "MHASERVE_API_KEYS") for k in settings.api_keys.keys]
    return keys


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class KeyRing:
    """The digests of the accepted keys."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = [_digest(k) for k in keys]

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"KeyRing(<{len(self._digests)} keys>)"

    def accepts(self, presented: str | bytes) -> bool:
        """Constant time in the key presented and in which key matched: every digest is compared."""
        digest = _digest(presented)
        match = False
        for d in self._digests:
            match |= hmac.compare_digest(digest, d)
        return match


def bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> tuple[str | bytes | None, str]:
    """The token of `authorization: Bearer <token>`, or None and why not (for the log; never the token)."""
    values = [v for k, v in metadata or () if k == AUTHORIZATION]
    if not values:
        return None, "no authorization metadata"
    if len(values) > 1:
        return None, "more than one authorization header"
    value = values[0]
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    scheme, _, token = text.strip().partition(" ")
    if scheme.lower() != SCHEME or not token.strip():
        return None, "authorization is not 'Bearer <key>'"
    return token.strip(), "unknown key"


def is_open(method: str, open_methods: Sequence[str]) -> bool:
    """Whether `method` is listed, exactly or by its service's `/pkg.Service/*`."""
    return any(m == method or (m.endswith("/*") and method.startswith(m[:-1])) for m in open_methods)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call to a method not in `open_methods` that lacks a valid key, with UNAUTHENTICATED.

    It runs first, so a refused call never reaches the readiness gate, the request id or the handler;
    it is counted in `mhaserve_requests_total{code="UNAUTHENTICATED"}` here.
    """

    MESSAGE = "missing or invalid API key: send metadata 'authorization: Bearer <key>'"

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
        return _refusal(handler, self.MESSAGE)


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED without reading the request."""

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as streaming handlers are

    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, **codec)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming, **codec)
    return grpc.stream_stream_rpc_method_handler(streaming, **codec)
