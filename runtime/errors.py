"""The errors a client may see, whatever the protocol: one class per kind of failure.

Every layer raises these (the engine refuses a batch, the repository misses a model, the pipeline finds
the queue full); `mhaserve.service.errors` is the one place that maps them to a gRPC status or an HTTP
status. Every class has the same attributes (`message`, `param`), so the mapper can never crash on the
error it should report (kserve's trap), and nothing here knows a protocol.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base of every error a client may see; `message` is safe to send (no stack traces, no secrets).

    `param` names the request field at fault where one is (OpenAI's error shape reports it).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidArgument(ServiceError):
    """The request is malformed or asks for something the model cannot do."""


class RequestTimeout(InvalidArgument):
    """The client took too long to send its request (HTTP 408)."""


class UnsupportedMediaType(InvalidArgument):
    """A request body in a format the API does not read (HTTP 415)."""


class FailedPrecondition(ServiceError):
    """The server is not in a state that allows this (a repository call under another model control)."""


class NotFound(ServiceError):
    """The request names a model or version that is not served."""


class ResourceExhausted(ServiceError):
    """A limit refuses the request: the queue is full (retry later) or the request is too large."""


class QueueFull(ResourceExhausted):
    """The queue holds its limit already: retry later (HTTP 429, with Retry-After)."""


class TooLarge(ResourceExhausted):
    """The request itself is over a size limit: retrying it cannot help (HTTP 413)."""


class Unavailable(ServiceError):
    """The model is loading, stalled, or the server is draining: retry, on another replica if there is one."""


class InferenceTimeout(Unavailable):
    """A batch computed for longer than the inference timeout (the watchdog): HTTP 504."""


class Unimplemented(ServiceError):
    """The server has no such method (gRPC), the route takes another HTTP method (HTTP 405), or a call asks what the
    method does not do (a compression it does not read; a second request message where it takes one, gRPC's
    "cardinality violation")."""


class DeadlineExceeded(ServiceError):
    """The client's deadline passed."""


class Cancelled(ServiceError):
    """The client went away."""


class Unauthenticated(ServiceError):
    """No valid API key."""


class PermissionDenied(ServiceError):
    """A valid key that may not do this (an admin call with a client key)."""


class Internal(ServiceError):
    """A bug or an engine failure; the message stays short and the details go to the log."""


def reason(error: BaseException) -> str:
    """One line saying why `error` happened, for a log line or a one-line error: a ServiceError's message,
    else the first line of its text, else its type's name (an empty text has no first line)."""
    text = getattr(error, "message", None) or str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
