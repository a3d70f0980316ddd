"""The one map from an error to what a client sees: a gRPC status, or an HTTP status and error type.

The errors themselves are protocol-neutral (`mhaserve.runtime.errors`); adapters never choose a status
of their own (the HTTP router's own 404 and 405 become NotFound and Unimplemented too). Anything that is
not a ServiceError is a bug: its text may hold internals, so it never leaves the server (the interceptor
or middleware logs it with the request id, which the client's message names).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from mhaserve.runtime.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InferenceTimeout,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QueueFull,
    RequestTimeout,
    ResourceExhausted,
    ServiceError,
    TooLarge,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    UnsupportedMediaType,
)

# Messages may quote what a client sent (a model name, a tensor name). A status travels in trailing
# metadata, percent-encoded (3 bytes for each byte outside printable ASCII), and clients refuse
# metadata past 8 KiB by default: a long message is cut here, for every API, to this encoded size.
MAX_MESSAGE_BYTES = 2048


@dataclass(frozen=True)
class HttpStatus:
    """An HTTP status and the OpenAI error `type` that goes with it (what the official clients read)."""

    status: int
    type: str


# Most specific first: a subclass must come before its base.
_GRPC: tuple[tuple[type[ServiceError], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Cancelled, grpc.StatusCode.CANCELLED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (Unimplemented, grpc.StatusCode.UNIMPLEMENTED),
    (Internal, grpc.StatusCode.INTERNAL),
)

# The statuses the official OpenAI clients map to their exception classes (BadRequestError 400,
# AuthenticationError 401, PermissionDeniedError 403, NotFoundError 404, RateLimitError 429,
# InternalServerError >= 500).
_HTTP: tuple[tuple[type[ServiceError], HttpStatus], ...] = (
    (RequestTimeout, HttpStatus(408, "invalid_request_error")),
    (UnsupportedMediaType, HttpStatus(415, "invalid_request_error")),
    (InvalidArgument, HttpStatus(400, "invalid_request_error")),
    (NotFound, HttpStatus(404, "invalid_request_error")),
    (FailedPrecondition, HttpStatus(400, "invalid_request_error")),
    (QueueFull, HttpStatus(429, "rate_limit_error")),
    (TooLarge, HttpStatus(413, "invalid_request_error")),
    (ResourceExhausted, HttpStatus(429, "rate_limit_error")),
    (InferenceTimeout, HttpStatus(504, "server_error")),
    (Unavailable, HttpStatus(503, "server_error")),
    (DeadlineExceeded, HttpStatus(504, "server_error")),
    (Cancelled, HttpStatus(499, "server_error")),
    (Unauthenticated, HttpStatus(401, "authentication_error")),
    (PermissionDenied, HttpStatus(403, "permission_error")),
    (Unimplemented, HttpStatus(405, "invalid_request_error")),
    (Internal, HttpStatus(500, "server_error")),
)
INTERNAL_HTTP = HttpStatus(500, "server_error")


def grpc_code(error: BaseException) -> grpc.StatusCode:
    """The gRPC status code of an error: its class's, INTERNAL for anything else."""
    for cls, code in _GRPC:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


# seconds: a call cancelled this close to its deadline (or past it) ended by its deadline. grpc cancels a call's
# task when the client's deadline passes, and the server's copy of that deadline starts when the headers
# arrive, a little later (milliseconds on a busy machine), so "just before" means expired.
DEADLINE_SLACK = 0.1


# The message a request's task is cancelled with when the server's grace period ends (`abandon`): its client
# is answered UNAVAILABLE, and the pipeline's metrics, which see only the cancellation, count it so too.
ABANDONED = "the server's grace period ended"


def status_name(error: BaseException, time_left: float | None = None) -> str:
    """The status a request that ended with `error` is counted under in the metrics (a gRPC status name):
    its class's, and for a cancelled task (the client went away, or the server stopped) CANCELLED, or
    DEADLINE_EXCEEDED where `time_left` (seconds until the call's deadline, at its end) says the deadline ended it,
    or UNAVAILABLE where the server's grace period ended it (ABANDONED), as its client is answered."""
    if isinstance(error, asyncio.CancelledError):
        if error.args == (ABANDONED,):
            return "UNAVAILABLE"
        return "DEADLINE_EXCEEDED" if time_left is not None and time_left <= DEADLINE_SLACK else "CANCELLED"
    return grpc_code(error).name


def to_status(error: BaseException, request_id: str | None = None) -> tuple[grpc.StatusCode, str]:
    """What a gRPC client sees: the error's status and message, or INTERNAL and "internal error" for a bug.
    With `request_id`, an INTERNAL message says where the details are."""
    if isinstance(error, ServiceError):
        code, message = grpc_code(error), shorten(error.message)
    else:
        code, message = grpc.StatusCode.INTERNAL, "internal error"
    return code, _pointing_to_the_log(message, request_id) if code == grpc.StatusCode.INTERNAL else message


def to_http(error: BaseException, request_id: str | None = None) -> tuple[HttpStatus, str]:
    """What an HTTP client sees: the status and error type, and the message (the same one gRPC sends)."""
    status, message = INTERNAL_HTTP, "internal error"
    if isinstance(error, ServiceError):
        status = next((s for cls, s in _HTTP if isinstance(error, cls)), INTERNAL_HTTP)
        message = shorten(error.message)
    return status, _pointing_to_the_log(message, request_id) if status.status == 500 else message


def _pointing_to_the_log(message: str, request_id: str | None) -> str:
    """A server error's message names the request id its details are logged under (they never leave the server)."""
    return message if request_id is None else f"{message} (request id {request_id}; details are in the server log)"


def shorten(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """The message, cut so that its percent-encoded form (as gRPC sends it) stays under `limit` bytes."""
    if len(message) * 12 <= limit - 64:  # 4 UTF-8 bytes a character at most, 3 encoded bytes each: fits as it is
        return message  # (the loop below took 6 us warm, 13 us a refusal on a busy event loop; most are short)
    size = 0
    for i, ch in enumerate(message):
        size += 1 if " " <= ch <= "~" and ch != "%" else 3 * len(ch.encode("utf-8", "surrogatepass"))
        if size > limit - 64:
            return message[:i] + f"... (cut: {len(message)} characters in all)"
    return message
