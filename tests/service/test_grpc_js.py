"""Node's gRPC client (@grpc/grpc-js, on Node's own HTTP/2: nghttp2) against the server, on each gRPC front.

grpcio's clients speak grpc core's HTTP/2, and grpclib hyper-h2's (test_server.py); grpc-js is the client
JavaScript users have, on a third implementation. Its packages are installed by `make test` from
tests/service/grpc_js/package-lock.json; tests/service/grpc_js/client.js makes the calls and prints JSON.
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

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "tests" / "service" / "grpc_js"
NODE = shutil.which("node")
TEXTS = ["hello world", "héllo wörld 🤖", "the quick brown fox " * 5]
NOT_FOUND = 5  # grpc's status codes as numbers, as grpc-js reports them

pytestmark = pytest.mark.skipif(
    NODE is None or not (CLIENT / "node_modules" / ".stamp").is_file(),
    reason="grpc-js is not installed (tests/service/grpc_js/node_modules): run the suite with `make test`",
)


def grpc_js(address: str, texts: list[str]) -> Any:
    assert NODE is not None
    proc = subprocess.run(
        [NODE, str(CLIENT / "client.js"), address, str(ROOT / "proto"), json.dumps(texts)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"client.js failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def test_grpc_js_encodes_as_grpcio_does_and_reads_errors_and_streams(server: ServerThread) -> None:
    with server.channel() as channel:
        expected = pb_grpc.EncoderServiceStub(channel).Encode(
            pb.EncodeRequest(texts=TEXTS, normalize=False), timeout=WAIT
        )
    want = np.array([e.values for e in expected.embeddings], dtype=np.float32)
    got = grpc_js(server.address, TEXTS)
    np.testing.assert_allclose(np.array(got["embeddings"], dtype=np.float32), want, atol=1e-6, rtol=0)
    assert got["model"] == ["tiny", 1]
    assert got["not_found"]["code"] == NOT_FOUND and "nope" in got["not_found"]["details"]
    width = want.shape[1]
    # EncodeStream: the first request answered, the second's error in its answer, the stream ended with OK.
    assert got["stream"] == {"code": 0, "widths": [[width], []], "errors": [0, NOT_FOUND]}
