"""Java's gRPC client (grpc-java, on Netty's HTTP/2 codec) against the server, on each gRPC front.

grpcio's clients speak grpc core's HTTP/2, grpclib hyper-h2's (test_server.py), grpc-js nghttp2's
(test_grpc_js.py) and grpc-go Go's own (test_grpc_go.py); grpc-java is the client JVM services have, on
Netty's. It is built by `make test` from Debian's Java packages (tests/service/grpc_java/build.sh, offline:
.ci/run installs them); tests/service/grpc_java/Client.java makes the calls and prints JSON.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.testing.loopback import WAIT
from mhaserve.testing.server import ServerThread

BUILD = Path(__file__).resolve().parent / "grpc_java" / "build"
JAVA = shutil.which("java")
TEXTS = ["hello world", "héllo wörld 🤖", "the quick brown fox " * 5]
OK, NOT_FOUND = 0, 5  # grpc's status codes as numbers, as grpc-java reports them

pytestmark = pytest.mark.skipif(
    JAVA is None or not (BUILD / ".stamp").is_file(),
    reason="grpc-java's client is not built (tests/service/grpc_java/build): run the suite with `make test`, "
    "with Debian's libgrpc-java, libprotobuf-java, libnetty-java, protobuf-compiler-grpc-java-plugin and a JDK",
)


def grpc_java(address: str, texts: list[str]) -> Any:
    assert JAVA is not None
    classpath = (BUILD / "classpath").read_text().strip()
    proc = subprocess.run(
        [JAVA, "-cp", classpath, "Client", address, *texts], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"the Java client failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def test_grpc_java_encodes_as_grpcio_does_and_reads_errors_and_streams(server: ServerThread) -> None:
    with server.channel() as channel:
        expected = pb_grpc.EncoderServiceStub(channel).Encode(
            pb.EncodeRequest(texts=TEXTS, normalize=False), timeout=WAIT
        )
    want = np.array([e.values for e in expected.embeddings], dtype=np.float32)
    assert not np.allclose(np.linalg.norm(want, axis=1), 1.0)  # normalize=false reached the server
    got = grpc_java(server.address, TEXTS)
    np.testing.assert_allclose(np.array(got["embeddings"], dtype=np.float32), want, atol=1e-6, rtol=0)
    # The packed answer: the same float32 values, read from bytes.
    np.testing.assert_array_equal(np.array(got["packed"], dtype=np.float32), np.array(got["embeddings"], np.float32))
    assert got["model"] == ["tiny", 1]
    assert got["request_id"] == "java-1"  # the client's request id, sent back in the trailers
    assert got["not_found"]["code"] == NOT_FOUND and "nope" in got["not_found"]["message"]
    width = want.shape[1]
    # EncodeStream: the first request answered, the second's error in its answer, the stream ended with OK.
    assert got["stream"] == {"code": OK, "widths": [[width], []], "errors": [0, NOT_FOUND]}
