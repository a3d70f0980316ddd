"""Rust's HTTP/2 (the h2 crate: hyper's, and so tonic's) against the server, on each gRPC front.

grpcio's clients speak grpc core's HTTP/2, grpclib hyper-h2's (test_server.py), grpc-js nghttp2's, grpc-go Go's
and grpc-java Netty's (test_grpc_{js,go,java}.py); Rust services call gRPC with tonic, on hyper and h2, a sixth
implementation. tonic itself is not packaged where the suite installs from, so tests/service/rust_h2 is a
client on h2 alone, with hyper's settings for a client (its windows), built by `make test` from Debian's crates
(tests/service/rust_h2/build.sh; .ci/run installs them). It carries gRPC's framing and no protobuf: these tests
encode each request and decode each answer with the project's stubs. Over TLS with rustls, tonic's TLS, it is
tested in tests/security/test_tls.py.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from grpc_health.v1 import health_pb2

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.service import server as server_module
from mhaserve.service.rpc.lean import frames as f
from mhaserve.service.settings import Settings
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.loopback import WAIT, wait_until
from mhaserve.testing.server import ServerThread
from tests.service.interop import (
    NOT_FOUND,
    OK,
    TEXTS,
    assert_answered_as_grpcio_was,
    assert_packed_as_plain,
    grpcio_answer,
)
from tests.service.rust_h2_client import (
    CHECK,
    CLIENT,
    ENCODE,
    ENCODE_STREAM,
    call,
    h2_client,
    needs_client,
    only,
    status,
)

pytestmark = needs_client


def rounds(address: str, *calls: list[dict[str, Any]], **options: Any) -> list[list[list[Any]]]:
    return h2_client(address, *calls, **options)["rounds"]


def embeddings(message: bytes) -> npt.NDArray[np.float32]:
    return np.array([e.values for e in pb.EncodeResponse.FromString(message).embeddings], dtype=np.float32)


def test_hypers_http2_encodes_as_grpcio_does_and_reads_errors_streams_and_health(server: ServerThread) -> None:
    want = grpcio_answer(server)
    plain = pb.EncodeRequest(texts=TEXTS, normalize=False)
    packed = pb.EncodeRequest(texts=TEXTS, normalize=False, packed=True)
    nope = pb.EncodeRequest(texts=["x"], model="nope")
    [[encoded], [as_bytes], [not_found], [stream], [health]] = rounds(
        server.address,
        [
            call(ENCODE, plain.SerializeToString(), metadata=(("x-request-id", "rs-1"), ("grpc-timeout", "30S"))),
            call(ENCODE, packed.SerializeToString()),
            call(ENCODE, nope.SerializeToString()),
            call(ENCODE_STREAM, pb.EncodeRequest(texts=TEXTS[:1]).SerializeToString(), nope.SerializeToString()),
            call(CHECK, health_pb2.HealthCheckRequest().SerializeToString()),
        ],
    )[0]
    answer = pb.EncodeResponse.FromString(only(encoded))
    packed_answer = pb.EncodeResponse.FromString(only(as_bytes))
    width = packed_answer.dimensions
    code, message = status(not_found)
    assert not_found["messages"] == []
    stream_answers = [pb.EncodeResponse.FromString(bytes.fromhex(m)) for m in stream["messages"]]
    got = {
        "embeddings": embeddings(only(encoded)).tolist(),
        "model": [answer.model, answer.model_version],
        "packed": np.frombuffer(packed_answer.packed, dtype="<f4").reshape(-1, width).tolist(),
        "not_found": {"code": code, "message": message},
        "stream": {
            "code": status(stream)[0],
            "widths": [[len(e.values) for e in a.embeddings] for a in stream_answers],
            "errors": [a.error.code if a.HasField("error") else 0 for a in stream_answers],
        },
    }
    assert_answered_as_grpcio_was(got, want, message="message")
    assert_packed_as_plain(got)
    assert encoded["trailers"]["x-request-id"] == "rs-1"  # the client's request id, sent back in the trailers
    assert code == NOT_FOUND
    assert health_pb2.HealthCheckResponse.FromString(only(health)).status == health_pb2.HealthCheckResponse.SERVING


def test_flow_control_both_ways_a_request_past_the_servers_window_and_a_one_byte_window(server: ServerThread) -> None:
    """A request larger than the server's initial window waits for its WINDOW_UPDATEs; an answer to a client
    whose window is one byte goes out a byte a frame, each after the client's credit."""
    texts = [f"{i} " + "lorem ipsum dolor " * 2_000 for i in range(8)]
    large = pb.EncodeRequest(texts=texts, normalize=False, truncate=True)
    assert large.ByteSize() > 2 * f.DEFAULT_WINDOW
    small = pb.EncodeRequest(texts=TEXTS, normalize=False)
    [[big], [tiny]] = rounds(
        server.address, [call(ENCODE, large.SerializeToString()), call(ENCODE, small.SerializeToString())], window=1
    )[0]
    np.testing.assert_allclose(embeddings(only(tiny)), grpcio_answer(server), atol=1e-6, rtol=0)
    assert embeddings(only(big)).shape[0] == 8


def test_a_client_that_keeps_the_stream_limit_full_is_answered(server: ServerThread, grpc_front: str) -> None:
    """h2 opens a stream as soon as one ends, and keeps the limit the server advertised (once its SETTINGS
    arrived: hence a first round of one call). On the lean front every call is answered. grpc core counts a call
    until grpc.aio has released it, a turn of the event loop after its trailers went out (its defence against
    rapid resets, kept): there a stream h2 opens in that turn is refused, REFUSED_STREAM, never seen by the
    service, which tonic reads as UNAVAILABLE (docs/grpc-fronts.md)."""
    request = pb.EncodeRequest(texts=TEXTS[:2], normalize=False).SerializeToString()
    many = 2 * server_module.MAX_STREAMS + 500
    [[[first]], [answers]] = rounds(server.address, [call(ENCODE, request)], [call(ENCODE, request, copies=many)])
    want = embeddings(only(first))
    refused = [a for a in answers if "reset" in a]
    assert all(a["reset"] == f.REFUSED_STREAM for a in refused), refused[:3]
    if grpc_front == "lean":
        assert refused == []
    for answer in answers:
        if "reset" not in answer:
            np.testing.assert_allclose(embeddings(only(answer)), want, atol=1e-5, rtol=0)
    assert len(answers) == many


def test_a_drain_answers_every_call_h2_has_open_and_ends_its_connection_cleanly(
    settings: Settings, grpc_front: str, tmp_path: Path
) -> None:
    """A rolling deploy as a tonic client meets it: the server drains (SIGTERM) while h2 has calls open on its
    connection. Every one is answered, and the connection ends (the GOAWAYs, the close) in a way h2 takes
    without an error: the client exits 0, which it does not on an error of the connection."""
    engine = ScriptedEngine(seconds_per_batch=0.3, record=False)
    slow = dataclasses.replace(settings, grpc_front=grpc_front, grace_period=2 * WAIT)
    srv = ServerThread(slow, engine.factory()).ready()
    try:
        request = pb.EncodeRequest(texts=["a drain"]).SerializeToString()
        spec = {"address": srv.address, "rounds": [[call(ENCODE, request)], [call(ENCODE, request, copies=24)]]}
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        with (tmp_path / "spec.json").open() as stdin:
            client = subprocess.Popen([str(CLIENT)], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            wait_until(lambda: srv.gauge("mhaserve_requests_in_flight") >= 24, "the calls to be open")
            stopping = threading.Thread(target=srv.call, args=(srv.server.stop(),), kwargs={"timeout": 2 * WAIT})
            stopping.start()
            out, err = client.communicate(timeout=2 * WAIT)
            stopping.join(2 * WAIT)
        finally:
            client.kill()
        assert client.returncode == 0, err.decode()[-4000:]
        answers = json.loads(out)["rounds"][1][0]
        assert [status(a)[0] for a in answers] == [OK] * 24
    finally:
        srv.stop()
