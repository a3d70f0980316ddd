"""Java's gRPC client (grpc-java, on Netty's HTTP/2 codec) against the server, on each gRPC front.

grpcio's clients speak grpc core's HTTP/2, grpclib hyper-h2's (test_server.py), grpc-js nghttp2's
(test_grpc_js.py) and grpc-go Go's own (test_grpc_go.py); grpc-java is the client JVM services have, on
Netty's. It is built by `make test` from Debian's Java packages (tests/service/grpc_java/build.sh, offline:
.ci/run installs them); tests/service/grpc_java/Client.java makes the calls and prints JSON.
"""

from __future__ import annotations

import shutil
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

BUILD = Path(__file__).resolve().parent / "grpc_java" / "build"
JAVA = shutil.which("java")

pytestmark = pytest.mark.skipif(
    JAVA is None or not (BUILD / ".stamp").is_file(),
    reason="grpc-java's client is not built (tests/service/grpc_java/build): run the suite with `make test`, "
    "with Debian's libgrpc-java, libprotobuf-java, libnetty-java, protobuf-compiler-grpc-java-plugin and a JDK",
)


def grpc_java(address: str, texts: list[str]) -> Any:
    assert JAVA is not None
    classpath = (BUILD / "classpath").read_text().strip()
    return run_client([JAVA, "-cp", classpath, "Client", address, *texts], "the Java client")


def test_grpc_java_encodes_as_grpcio_does_and_reads_errors_and_streams(server: ServerThread) -> None:
    want = grpcio_answer(server)
    got = grpc_java(server.address, TEXTS)
    assert_answered_as_grpcio_was(got, want, message="message")
    assert_packed_as_plain(got)
    assert got["request_id"] == "java-1"  # the client's request id, sent back in the trailers
