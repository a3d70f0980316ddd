"""The one map from an error to what a client sees, for gRPC and for HTTP."""

from __future__ import annotations

import grpc
import pytest

from mhaserve.runtime import errors as e
from mhaserve.service.errors import shorten, to_http, to_status

CASES = [
    (e.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (e.NotFound, grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error"),
    (e.QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (e.TooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED, 413, "invalid_request_error"),
    (e.Unavailable, grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
    (e.InferenceTimeout, grpc.StatusCode.UNAVAILABLE, 504, "server_error"),
    (e.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error"),
    (e.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    (e.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
    (e.Unimplemented, grpc.StatusCode.UNIMPLEMENTED, 405, "invalid_request_error"),
    (e.Internal, grpc.StatusCode.INTERNAL, 500, "server_error"),
]


@pytest.mark.parametrize(("error", "code", "status", "kind"), CASES, ids=lambda c: getattr(c, "__name__", None))
def test_each_error_has_one_grpc_code_and_one_http_status(
    error: type[e.ServiceError], code: grpc.StatusCode, status: int, kind: str
) -> None:
    internal = " (request id r1; details are in the server log)" if code == grpc.StatusCode.INTERNAL else ""
    assert to_status(error("because")) == (code, "because")
    assert to_status(error("because"), "r1") == (code, "because" + internal)
    http, message = to_http(error("because"))
    assert (http.status, http.type, message) == (status, kind, "because")
    assert to_http(error("because"), "r1")[1] == "because" + internal


def test_a_subclass_answers_as_its_base() -> None:
    class Odd(e.InvalidArgument):
        pass

    assert to_status(Odd("x"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert to_http(Odd("x"))[0].status == 400


def test_anything_else_is_a_bug_and_says_nothing() -> None:
    assert to_status(KeyError("secret /etc/passwd")) == (grpc.StatusCode.INTERNAL, "internal error")
    assert to_http(KeyError("secret /etc/passwd"))[1] == "internal error"
    assert to_http(KeyError("x"))[0].status == 500


def test_long_messages_are_cut_for_metadata() -> None:
    cut = shorten("é" * 5000)
    assert len(cut.encode()) < 2048 and cut.endswith("(cut: 5000 characters in all)")
    assert to_status(e.InvalidArgument("x" * 10_000))[1] == shorten("x" * 10_000)


def _encoded_size(text: str) -> int:
    """Bytes of `text` percent-encoded as gRPC sends a status message."""
    return sum(1 if " " <= c <= "~" and c != "%" else 3 * len(c.encode()) for c in text)


@pytest.mark.parametrize("ch", ["x", "%", "é", "€", "\U0001f600"])
def test_a_message_that_fits_is_sent_whole_and_one_that_does_not_is_cut(ch: str) -> None:
    """Short messages skip the character-by-character count; both sides of that shortcut stay under the limit."""
    for n in (1, 100, 165, 166, 400, 3000):
        message = ch * n
        cut = shorten(message)
        assert _encoded_size(cut) <= 2048
        assert (cut == message) == (_encoded_size(message) <= 2048 - 64)
