"""What the interop tests (test_grpc_js.py, test_grpc_go.py, test_grpc_java.py, test_rust_h2.py) check of
another language's gRPC client: each runs a client program that makes the same calls and prints what it got as
JSON."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import numpy as np
import numpy.typing as npt

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.testing.loopback import WAIT
from mhaserve.testing.server import ServerThread

TEXTS = ["hello world", "héllo wörld 🤖", "the quick brown fox " * 5]
OK, NOT_FOUND = 0, 5  # grpc's status codes as numbers, as the other clients report them


def run_client(argv: list[str], name: str, stdin: str | None = None) -> Any:
    """Run a client program (given `stdin`, if any); what it printed, as JSON."""
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def grpcio_answer(server: ServerThread) -> npt.NDArray[np.float32]:
    """TEXTS' embeddings, unnormalised, as grpcio's client gets them: what the other client must get."""
    with server.channel() as channel:
        expected = pb_grpc.EncoderServiceStub(channel).Encode(
            pb.EncodeRequest(texts=TEXTS, normalize=False), timeout=WAIT
        )
    want = np.array([e.values for e in expected.embeddings], dtype=np.float32)
    assert not np.allclose(np.linalg.norm(want, axis=1), 1.0)  # normalize=false reached the server
    return want


def assert_answered_as_grpcio_was(got: dict[str, Any], want: npt.NDArray[np.float32], message: str) -> None:
    """The client's answers: Encode's embeddings and model, a model that does not exist (its status and the
    error's `message` field), and EncodeStream (the first request answered, the second's error in its answer,
    the stream ended with OK)."""
    np.testing.assert_allclose(np.array(got["embeddings"], dtype=np.float32), want, atol=1e-6, rtol=0)
    assert got["model"] == ["tiny", 1]
    assert got["not_found"]["code"] == NOT_FOUND and "nope" in got["not_found"][message]
    width = want.shape[1]
    assert got["stream"] == {"code": OK, "widths": [[width], []], "errors": [0, NOT_FOUND]}


def assert_packed_as_plain(got: dict[str, Any]) -> None:
    """The packed answer (float32 bytes) read by the client: the same values as the plain one."""
    np.testing.assert_array_equal(
        np.array(got["packed"], dtype=np.float32), np.array(got["embeddings"], dtype=np.float32)
    )
