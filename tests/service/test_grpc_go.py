"""Go's gRPC client (grpc-go, on Go's own HTTP/2 framing and HPACK) against the server, on each gRPC front.

grpcio's clients speak grpc core's HTTP/2, grpclib hyper-h2's (test_server.py) and grpc-js nghttp2's
(test_grpc_js.py); grpc-go is the client Go services have, on a fourth implementation. It is built by `make
test` from Debian's Go packages (tests/service/grpc_go/build.sh, offline: .ci/run installs them);
tests/service/grpc_go/client.go makes the calls and prints JSON.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.testing.loopback import WAIT
from mhaserve.testing.server import ServerThread

BUILD = Path(__file__).resolve().parent / "grpc_go" / "build"
CLIENT = BUILD / "client"
TEXTS = ["hello world", "héllo wörld 🤖", "the quick brown fox " * 5]
# grpc's status codes as numbers, as grpc-go reports them
OK, NOT_FOUND = 0, 5

pytestmark = pytest.mark.skipif(
    not (BUILD / ".stamp").is_file(),
    reason="grpc-go's client is not built (tests/service/grpc_go/build): run the suite with `make test`, "
    "with Debian's golang-go, golang-google-grpc-dev, golang-goprotobuf-dev and protobuf-compiler installed",
)


def grpc_go(address: str, texts: list[str]) -> Any:
    proc = subprocess.run([str(CLIENT), address, json.dumps(texts)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"the Go client failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def test_grpc_go_encodes_as_grpcio_does_and_reads_errors_streams_and_health(server: ServerThread) -> None:
    with server.channel() as channel:
        expected = pb_grpc.EncoderServiceStub(channel).Encode(
            pb.EncodeRequest(texts=TEXTS, normalize=False), timeout=WAIT
        )
    want = np.array([e.values for e in expected.embeddings], dtype=np.float32)
    assert not np.allclose(np.linalg.norm(want, axis=1), 1.0)  # normalize=false reached the server
    got = grpc_go(server.address, TEXTS)
    np.testing.assert_allclose(np.array(got["embeddings"], dtype=np.float32), want, atol=1e-6, rtol=0)
    # The packed answer: the same float32 values, read from bytes.
    np.testing.assert_array_equal(np.array(got["packed"], dtype=np.float32), np.array(got["embeddings"], np.float32))
    assert got["model"] == ["tiny", 1]
    assert got["request_id"] == ["go-1"]  # the client's request id, sent back in the trailers
    assert got["not_found"]["code"] == NOT_FOUND and "nope" in got["not_found"]["message"]
    width = want.shape[1]
    # EncodeStream: the first request answered, the second's error in its answer, the stream ended with OK.
    assert got["stream"] == {"code": OK, "widths": [[width], []], "errors": [0, NOT_FOUND]}
    assert got["health"] == "SERVING"
