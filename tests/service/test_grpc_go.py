"""Go's gRPC client (grpc-go, on Go's own HTTP/2 framing and HPACK) against the server, on each gRPC front.

grpcio's clients speak grpc core's HTTP/2, grpclib hyper-h2's (test_server.py) and grpc-js nghttp2's
(test_grpc_js.py); grpc-go is the client Go services have, on a fourth implementation. It is built by `make
test` from Debian's Go packages (tests/service/grpc_go/build.sh, offline: .ci/run installs them);
tests/service/grpc_go/client.go makes the calls and prints JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mhaserve.testing.server import ServerThread
from tests.service.interop import (
    TEXTS,
    assert_answered_as_grpcio_was,
    assert_packed_as_plain,
    grpcio_answer,
    run_client,
)

BUILD = Path(__file__).resolve().parent / "grpc_go" / "build"
CLIENT = BUILD / "client"

pytestmark = pytest.mark.skipif(
    not (BUILD / ".stamp").is_file(),
    reason="grpc-go's client is not built (tests/service/grpc_go/build): run the suite with `make test`, "
    "with Debian's golang-go, golang-google-grpc-dev, golang-goprotobuf-dev and protobuf-compiler installed",
)


def grpc_go(address: str, texts: list[str]) -> Any:
    return run_client([str(CLIENT), address, json.dumps(texts)], "the Go client")


def test_grpc_go_encodes_as_grpcio_does_and_reads_errors_streams_and_health(server: ServerThread) -> None:
    want = grpcio_answer(server)
    got = grpc_go(server.address, TEXTS)
    assert_answered_as_grpcio_was(got, want, message="message")
    assert_packed_as_plain(got)
    assert got["request_id"] == ["go-1"]  # the client's request id, sent back in the trailers
    assert got["health"] == "SERVING"
