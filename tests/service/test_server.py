"""The encoder.v1 API against a real server on a loopback port: results, status codes, limits, faults."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import grpclib.client
import grpclib.const
import grpclib.exceptions
import numpy as np
import numpy.typing as npt
import pytest
from google.protobuf.descriptor_pb2 import FileDescriptorProto
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.proto.inference.v2 import grpc_service_pb2 as kpb
from mhaserve.proto.inference.v2 import grpc_service_pb2_grpc as kpb_grpc
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.manifest import read_manifest
from mhaserve.runtime.tokenizer import load_for_serving
from mhaserve.service import client
from mhaserve.service import health as health_module
from mhaserve.service import server as server_module
from mhaserve.service.metrics import Metrics
from mhaserve.service.rpc.lean import frames as f
from mhaserve.service.settings import BATCHING, Batching, Settings
from mhaserve.testing import http
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.loopback import WAIT, free_port, wait_until
from mhaserve.testing.metrics import scrape
from mhaserve.testing.server import ServerThread, bare_settings
from tests.conftest import TINY
from tests.service.conftest import REFUSALS
from tests.service.raw_h2 import answered, answers, call_block, raw_exchange, read_until

Start = Callable[..., ServerThread]
ENCODE = "encoder.v1.EncoderService/Encode"
MAX = TINY["max_seq_len"]
# Varied lengths, so batches of them are padded: the results must not notice.
TEXTS = [
    "a",
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "x " * 60,
    "",
    "numbers 0123456789 and punctuation !?",
    "z" * 150,
    "short",
]


def ids(*rows: list[int]) -> pb.EncodeRequest:
    return pb.EncodeRequest(token_ids=[pb.TokenIds(ids=r) for r in rows])


def vectors(response: pb.EncodeResponse) -> npt.NDArray[np.float32]:
    return np.array([e.values for e in response.embeddings], dtype=np.float32)


def code_of(call: grpc.Future) -> grpc.StatusCode:
    """The call's final status (cancelled calls included), waiting at most WAIT for it."""
    wait_until(call.done, "the call to end")
    return call.code()


def counted(srv: ServerThread, code: str, method: str = ENCODE) -> float:
    value = srv.server.metrics.registry.get_sample_value("mhaserve_requests_total", {"method": method, "code": code})
    return value or 0.0


@pytest.fixture
def settings(tiny_repo: Path, grpc_front: str) -> Settings:
    """The package's settings fixture (conftest.py) on each gRPC front: this module's servers are gRPC's."""
    return bare_settings(tiny_repo, "tiny", grpc_front=grpc_front)


@pytest.fixture
def stub(server: ServerThread) -> Iterator[pb_grpc.EncoderServiceStub]:
    with server.channel() as channel:
        yield pb_grpc.EncoderServiceStub(channel)


@pytest.fixture(scope="module")
def reference(tiny_entry: Path) -> dict[str, npt.NDArray[np.float32]]:
    """Each text alone through the graph in-process, unnormalised: what the server must return."""
    m = read_manifest(tiny_entry)
    tok = load_for_serving(tiny_entry / "tokenizer.json", m.max_seq_len)
    engine = OnnxEngine(tiny_entry / "model.onnx", max_seq_len=m.max_seq_len, vocab_size=m.vocab_size, device="cpu")
    out = {}
    for text in TEXTS + [f"client {i} says {'ab ' * (i % 37)}" for i in range(200)]:
        seq = np.array([tok.encode(text).ids], dtype=np.int64)
        out[text] = engine.run(seq, np.ones_like(seq))[0]
    return out


# ---- results -------------------------------------------------------------------------------------


def test_encode_matches_the_graph_run_in_process(
    stub: pb_grpc.EncoderServiceStub, reference: dict, tiny_entry: Path
) -> None:
    r = stub.Encode(pb.EncodeRequest(texts=TEXTS, normalize=False), timeout=WAIT)
    np.testing.assert_allclose(vectors(r), np.stack([reference[t] for t in TEXTS]), atol=1e-5, rtol=0)
    assert (r.model, r.model_version) == ("tiny", 1)
    tokenizer = load_for_serving(tiny_entry / "tokenizer.json", MAX)
    assert r.usage.input_tokens == sum(len(tokenizer.encode(t).ids) for t in TEXTS)


@pytest.mark.parametrize("batching", BATCHING)
def test_results_do_not_depend_on_batch_composition(
    start: Start,
    settings: Settings,
    batching: Batching,
    reference: dict,
) -> None:
    srv = start(dataclasses.replace(settings, batching=batching, max_wait_ms=20.0))
    with srv.channel() as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        alone = np.stack([vectors(stub.Encode(pb.EncodeRequest(texts=[t]), timeout=WAIT))[0] for t in TEXTS])
        together = vectors(stub.Encode(pb.EncodeRequest(texts=TEXTS), timeout=WAIT))
        reversed_ = vectors(stub.Encode(pb.EncodeRequest(texts=TEXTS[::-1]), timeout=WAIT))[::-1]
        calls = [stub.Encode.future(pb.EncodeRequest(texts=[t]), timeout=WAIT) for t in TEXTS]
        concurrent = np.stack([vectors(c.result(timeout=WAIT))[0] for c in calls])
    for other in (together, reversed_, concurrent):
        assert np.abs(other - alone).max() <= 1e-5
    norms = np.linalg.norm(np.stack([reference[t] for t in TEXTS]), axis=1, keepdims=True)
    assert np.abs(alone - np.stack([reference[t] for t in TEXTS]) / norms).max() <= 1e-5  # the manifest normalises


def concurrent_answers(srv: ServerThread, texts: list[str]) -> npt.NDArray[np.float32]:
    """Each text from its own client, all at once; the embeddings in the order of `texts`."""
    channels = [srv.channel() for _ in texts]
    try:
        calls = [
            pb_grpc.EncoderServiceStub(ch).Encode.future(pb.EncodeRequest(texts=[t], normalize=False), timeout=WAIT)
            for ch, t in zip(channels, texts, strict=True)
        ]
        return np.stack([vectors(c.result(timeout=WAIT))[0] for c in calls])
    finally:
        for ch in channels:
            ch.close()


def test_a_grpc_client_on_another_http2_stack_encodes_and_reads_errors(server: ServerThread, reference: dict) -> None:
    """grpclib (hyper-h2, not grpc core) against the server on each front: embeddings, and the error map's
    status and message for a model that does not exist."""

    async def main() -> None:
        host, port = server.address.rsplit(":", 1)
        async with grpclib.client.Channel(host, int(port)) as channel:
            encode = grpclib.client.UnaryUnaryMethod(
                channel, "/encoder.v1.EncoderService/Encode", pb.EncodeRequest, pb.EncodeResponse
            )
            r = await encode(pb.EncodeRequest(texts=TEXTS, normalize=False), timeout=WAIT)
            np.testing.assert_allclose(vectors(r), np.stack([reference[t] for t in TEXTS]), atol=1e-5, rtol=0)
            with pytest.raises(grpclib.exceptions.GRPCError) as error:
                await encode(pb.EncodeRequest(texts=["x"], model="nope"), timeout=WAIT)
            assert error.value.status == grpclib.const.Status.NOT_FOUND
            assert "nope" in (error.value.message or "")

    asyncio.run(main())


def test_a_connection_holds_at_most_max_streams_calls_at_once_on_either_front(server: ServerThread) -> None:
    """The server advertises its limit of calls a connection (grpc core advertises none of its own) and refuses a
    stream opened past it with REFUSED_STREAM, which clients retry; the calls within it stay open."""
    limit = server_module.MAX_STREAMS
    encode = call_block("/encoder.v1.EncoderService/Encode")
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT) as raw:
        raw.sendall(f.PREFACE + f.settings())
        buf = bytearray()  # whole_frames takes each frame out of buf
        frames: list[tuple[int, int, int, bytes]] = []
        while not any(k == f.SETTINGS and not flags & f.ACK for k, flags, *_ in frames):
            buf += raw.recv(65536)
            frames += f.whole_frames(buf)
        advertised = next(p for k, flags, _, p in frames if k == f.SETTINGS and not flags & f.ACK)
        settings = {
            int.from_bytes(advertised[i : i + 2], "big"): advertised[i + 2 : i + 6]
            for i in range(0, len(advertised), 6)
        }
        assert int.from_bytes(settings[f.MAX_CONCURRENT_STREAMS], "big") == limit
        # Acknowledged, the limit holds (grpc core applies the settings its peer has acknowledged). Each call
        # opens and waits for its request, which never comes; one more is opened past the limit.
        opened = [f.frame(f.HEADERS, f.END_HEADERS, 2 * i + 1, encode) for i in range(limit + 1)]
        raw.sendall(f.frame(f.SETTINGS, f.ACK, 0, b"") + b"".join(opened))
        raw.settimeout(1.0)
        with contextlib.suppress(TimeoutError):
            while chunk := raw.recv(65536):
                buf += chunk
                frames += f.whole_frames(buf)
    resets = {sid: int.from_bytes(p[:4], "big") for k, _, sid, p in frames if k == f.RST_STREAM}
    assert resets == {2 * limit + 1: f.REFUSED_STREAM}


def test_keepalive_pings_are_held_to_grpc_cores_policy_on_either_front(server: ServerThread) -> None:
    """Four PINGs on a connection with no call: three answered, then a GOAWAY ENHANCE_YOUR_CALM saying
    "too_many_pings" (grpc's clients then ping half as often), whichever front serves the port."""
    pings = b"".join(f.frame(f.PING, 0, 0, i.to_bytes(8, "big")) for i in range(4))
    frames = raw_exchange(server.server.port, pings)
    goaways = [(int.from_bytes(p[4:8], "big"), p[8:]) for k, _, _, p in frames if k == f.GOAWAY]
    assert goaways == [(f.ENHANCE_YOUR_CALM, b"too_many_pings")]
    assert sum(k == f.PING and flags & f.ACK for k, flags, *_ in frames) >= 3


CLIENTS = [f"client {i} says {'ab ' * (i % 37)}" for i in range(200)]


def test_two_hundred_concurrent_clients_all_get_their_own_answer(server: ServerThread, reference: dict) -> None:
    got = concurrent_answers(server, CLIENTS)
    assert np.abs(got - np.stack([reference[t] for t in CLIENTS])).max() <= 1e-5


@pytest.mark.parametrize("workers", [2, 8])
def test_several_inference_workers_load_an_overlap_session_and_answer_the_same(
    start: Start, settings: Settings, reference: dict, workers: int
) -> None:
    """8 is what `--inference-workers auto` gives a 16-core host: up to seven batches at once on the one
    overlap session, each on its share of the cores (here 2 // 8 -> 1 thread)."""
    srv = start(dataclasses.replace(settings, intra_op_threads=None, inference_workers=workers))
    engine = srv.server.dataplane.pipelines()[0].model.engine
    assert isinstance(engine, OnnxEngine) and engine.overlap_session is not None
    got = concurrent_answers(srv, CLIENTS)
    assert np.abs(got - np.stack([reference[t] for t in CLIENTS])).max() <= 1e-5
    # --intra-op-threads fixes every batch's threads: one session, as with one worker
    srv = start(dataclasses.replace(settings, intra_op_threads=1, inference_workers=2))
    engine = srv.server.dataplane.pipelines()[0].model.engine
    assert isinstance(engine, OnnxEngine) and engine.overlap_session is None


def test_the_threads_in_the_start_up_log_count_the_cores_the_process_may_use(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    """In a container with a CPU quota the host's core count is not what the server sizes itself by: the
    log says both, so an operator sees why."""
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setattr("mhaserve.service.server.available_cpus", lambda: 4)
    two = dataclasses.replace(settings, intra_op_threads=None, inference_workers=2)

    def words(s: Settings, *, cpus: int, shared: bool = False) -> str:
        return server_module._threads_in_words(*server_module._intra_op_threads(s, s.workers, cpus, shared=shared))

    assert words(two, cpus=4) == (
        "all 4 cores (of the host's 64: affinity or cgroup quota) alone, 2 while another batch computes"
    )
    monkeypatch.setattr("mhaserve.service.server.available_cpus", lambda: 64)
    assert words(dataclasses.replace(two, inference_workers=1), cpus=64) == "all 64 cores"
    assert words(dataclasses.replace(two, intra_op_threads=3), cpus=64) == "3"
    # One of --processes 4 on 64 cores: a batch alone takes them all, one beside another process's its 16.
    one = dataclasses.replace(two, inference_workers=1)
    assert words(one, cpus=16, shared=True) == "all 64 cores alone, 16 while another batch computes"
    assert words(dataclasses.replace(one, intra_op_threads=3), cpus=16, shared=True) == "3"


def test_the_start_up_log_names_the_grpc_front(
    start: Start, settings: Settings, grpc_front: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="mhaserve.service.server")
    start(settings, ScriptedEngine().factory())
    listening = [r.getMessage() for r in caplog.records if r.getMessage().startswith("listening on")]
    front = "the lean gRPC front" if grpc_front == "lean" else "grpc.aio"
    assert len(listening) == 1 and f"plaintext, {front} (NOT_SERVING" in listening[0]


def test_normalize_and_truncate(stub: pb_grpc.EncoderServiceStub) -> None:
    raw = vectors(stub.Encode(pb.EncodeRequest(texts=["hello"], normalize=False), timeout=WAIT))
    unit = vectors(stub.Encode(pb.EncodeRequest(texts=["hello"], normalize=True), timeout=WAIT))
    default = vectors(stub.Encode(pb.EncodeRequest(texts=["hello"]), timeout=WAIT))
    assert abs(np.linalg.norm(raw) - 1) > 1e-3
    np.testing.assert_allclose(unit, raw / np.linalg.norm(raw), atol=1e-6)
    np.testing.assert_array_equal(default, unit)  # the tiny manifest says normalize

    long = stub.Encode(pb.EncodeRequest(texts=["a " * 200], truncate=True), timeout=WAIT)
    assert long.usage.input_tokens == MAX
    r = stub.Encode(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[7] * (MAX + 40))], truncate=True), timeout=WAIT)
    same = stub.Encode(ids([7] * MAX), timeout=WAIT)
    assert r.usage.input_tokens == MAX
    np.testing.assert_array_equal(vectors(r), vectors(same))


def test_requests_that_reach_a_model_are_counted_by_model_and_status(
    server: ServerThread, stub: pb_grpc.EncoderServiceStub
) -> None:
    """mhaserve_requests_total has no model label; mhaserve_model_requests_total says which model's requests
    succeed and fail. A name no model has reaches none: it is in the first only."""

    def counted(code: str) -> float:
        return server.samples().get("mhaserve_model_requests_total", model="tiny", version="1", code=code)

    before = {code: counted(code) for code in ("OK", "INVALID_ARGUMENT")}
    stub.Encode(pb.EncodeRequest(texts=["a", "b"]), timeout=WAIT)
    stub.EncodeStream(iter([pb.EncodeRequest(texts=["c"])]), timeout=WAIT).next()
    for request in (ids([2, 256, 3]), pb.EncodeRequest(model="nope", texts=["x"])):
        with pytest.raises(grpc.RpcError):
            stub.Encode(request, timeout=WAIT)
    assert counted("OK") - before["OK"] == 2
    assert counted("INVALID_ARGUMENT") - before["INVALID_ARGUMENT"] == 1
    assert server.samples().get("mhaserve_model_requests_total", model="nope") == 0


CODES = ("OK", "INVALID_ARGUMENT", "NOT_FOUND")


def test_encode_stream_answers_in_order_and_survives_a_bad_request(
    server: ServerThread, stub: pb_grpc.EncoderServiceStub
) -> None:
    method = "encoder.v1.EncoderService/EncodeStream"
    before = {c: server.samples().get("mhaserve_stream_responses_total", method=method, code=c) for c in CODES}
    requests = [
        pb.EncodeRequest(texts=["first"]),
        ids([2, 256, 3]),  # past the vocabulary: an error response, not the end of the stream
        pb.EncodeRequest(texts=["third", "fourth"]),
        pb.EncodeRequest(model="nope", texts=["x"]),
        ids([2, 5, 3]),
    ]
    responses = list(stub.EncodeStream(iter(requests), timeout=WAIT))
    assert len(responses) == len(requests)
    assert responses[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "token id 256" in responses[1].error.message and not responses[1].embeddings
    assert responses[3].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    # the stream's status is OK: each response is counted by the status it carries, for the alerts
    after = {c: server.samples().get("mhaserve_stream_responses_total", method=method, code=c) for c in CODES}
    assert {c: after[c] - before[c] for c in CODES} == {"OK": 3, "INVALID_ARGUMENT": 1, "NOT_FOUND": 1}
    for i in (0, 2, 4):
        assert not responses[i].HasField("error")
        expected = stub.Encode(requests[i], timeout=WAIT)
        np.testing.assert_allclose(vectors(responses[i]), vectors(expected), atol=1e-5)


def test_a_stream_of_large_requests_never_fills_the_queue_by_itself(start: Start, settings: Settings) -> None:
    """A stream's requests computing at once take half the queue at most (one request at least): 32 at once,
    whatever their inputs, overflowed a queue of 4 with requests of 3, refusing the stream's own requests with
    RESOURCE_EXHAUSTED on an idle server. KServe's ModelStreamInfer and JSON Lines bodies share the rule."""
    engine = ScriptedEngine(seconds_per_batch=0.01)
    srv = start(dataclasses.replace(settings, max_queue_size=4, max_client_batch_size=4), engine.factory())
    requests = [pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[2, 5 + i, 3])] * 3) for i in range(8)]
    with srv.channel() as channel:
        responses = list(pb_grpc.EncoderServiceStub(channel).EncodeStream(iter(requests), timeout=WAIT))
    assert [r.error.message for r in responses if r.HasField("error")] == []
    assert [len(r.embeddings) for r in responses] == [3] * 8


def test_model_info(stub: pb_grpc.EncoderServiceStub, tiny_entry: Path) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=WAIT)
    m = read_manifest(tiny_entry)
    assert (info.name, info.version, info.dimensions, info.max_tokens_per_input) == ("tiny", 1, 32, MAX)
    assert (info.vocab_size, info.layers, info.heads, info.pooling) == (256, 2, 4, m.pooling)
    # --graph auto on the CPU: the fused graph with its layer norms as plain operators
    assert info.graph == "optimized-cpu" and info.sha256 == m.graphs["optimized-cpu"].sha256
    assert info.execution_provider == "CPUExecutionProvider"
    assert (info.max_client_batch_size, info.max_batch_tokens, info.max_queue_size) == (8, 256, 8192)
    assert info.max_message_bytes == 4 * 1024 * 1024
    assert stub.GetModelInfo(pb.GetModelInfoRequest(model="tiny"), timeout=WAIT).name == "tiny"


# ---- status codes --------------------------------------------------------------------------------

INVALID = {
    "no inputs": (pb.EncodeRequest(), "no inputs"),
    "texts and token_ids": (
        pb.EncodeRequest(texts=["a"], token_ids=[pb.TokenIds(ids=[2, 3])]),
        "either texts or token_ids",
    ),
    "too many inputs": (pb.EncodeRequest(texts=["a"] * 9), "9 inputs in one request; the limit is 8"),
    "token id past the vocabulary": (
        ids([2, 3], [2, 256, 3]),
        "input 1 has token id 256, outside the vocabulary [0, 256)",
    ),
    "negative token id": (ids([-1, 3]), "token id -1"),
    "empty token list": (ids([2, 3], []), "input 1 is an empty token list"),
}


@pytest.mark.parametrize("case", INVALID)
def test_invalid_argument(stub: pb_grpc.EncoderServiceStub, case: str) -> None:
    request, message = INVALID[case]
    with pytest.raises(grpc.RpcError) as e:
        stub.Encode(request, timeout=WAIT)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


def test_a_long_input_is_cut_by_default(stub: pb_grpc.EncoderServiceStub) -> None:
    """--auto-truncate is on by default, as text-embeddings-inference has it and as sentence-transformers cuts a
    text at max_seq_length: a text or token list past the model's maximum is embedded as with truncate, where the
    request does not say. Its own truncate false wins (an `optional` field), as text-embeddings-inference reads
    truncate.unwrap_or(auto_truncate): it was a plain proto3 bool, whose false could not be told from unset, so an
    encoder.v1 client could not ask a long text refused but by restarting the server."""
    cut = stub.Encode(ids([7] * (MAX + 40)), timeout=WAIT)
    assert cut.usage.input_tokens == MAX
    np.testing.assert_array_equal(vectors(cut), vectors(stub.Encode(ids([7] * MAX), timeout=WAIT)))
    text = "a " * 200
    cut = stub.Encode(pb.EncodeRequest(texts=["a", text]), timeout=WAIT)
    asked = stub.Encode(pb.EncodeRequest(texts=["a", text], truncate=True), timeout=WAIT)
    assert cut.usage.input_tokens == asked.usage.input_tokens == 3 + MAX
    np.testing.assert_array_equal(vectors(cut), vectors(asked))
    for request in (pb.EncodeRequest(texts=["a", text], truncate=False), ids([7] * (MAX + 1))):
        request.truncate = False
        with pytest.raises(grpc.RpcError) as e:
            stub.Encode(request, timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens long" in e.value.details()


def test_no_auto_truncate_refuses_a_long_input(start: Start, settings: Settings) -> None:
    """--no-auto-truncate: an input past the model's maximum is refused, unless the request sets truncate."""
    srv = start(dataclasses.replace(settings, auto_truncate=False))
    refused = {
        "text too long": (
            pb.EncodeRequest(texts=["ok", "a " * 200]),
            f"input 1 is 202 tokens long, more than the model's maximum of {MAX}",
        ),
        "token ids too long": (ids([5] * (MAX + 1)), f"input 0 is {MAX + 1} tokens long"),
    }
    with srv.channel() as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        for case, (request, message) in refused.items():
            with pytest.raises(grpc.RpcError) as e:
                stub.Encode(request, timeout=WAIT)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details(), case
            request.truncate = True
            assert stub.Encode(request, timeout=WAIT).embeddings, case


def test_not_found(stub: pb_grpc.EncoderServiceStub) -> None:
    for call, request in (
        (stub.Encode, pb.EncodeRequest(model="nope", texts=["a"])),
        (stub.GetModelInfo, pb.GetModelInfoRequest(model="nope")),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'nope' is not served here" in e.value.details()


def test_message_too_large_is_resource_exhausted(start: Start, settings: Settings) -> None:
    srv = start(dataclasses.replace(settings, max_message_bytes=2048))
    with srv.channel() as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        assert stub.Encode(pb.EncodeRequest(texts=["a" * 1000]), timeout=WAIT).embeddings
        with pytest.raises(grpc.RpcError) as e:
            stub.Encode(pb.EncodeRequest(texts=["a" * 1000] * 3), timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Under the limit compressed, over it once inflated: refused too (grpc core, and the lean front, stop
        # inflating at the limit), and a compressed request within it is served.
        with pytest.raises(grpc.RpcError) as e:
            stub.Encode(pb.EncodeRequest(texts=["a" * 1000] * 3), compression=grpc.Compression.Gzip, timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in e.value.details()
        one = pb.EncodeRequest(texts=["a" * 1000])
        assert stub.Encode(one, compression=grpc.Compression.Gzip, timeout=WAIT).embeddings


def test_a_message_too_large_is_counted_on_the_lean_front(start: Start, settings: Settings, grpc_front: str) -> None:
    """The lean front refused a unary call's message over --max-message-bytes before the call's bookkeeping began,
    and counted nothing, where HTTP counts its 413 under the route (so MhaserveShedding missed it). Now counted
    under the method the call named, as HTTP's; health is not counted, as ever. grpc.aio's front refuses it inside
    grpc core, where no interceptor sees it: uncounted (README)."""
    srv = start(dataclasses.replace(settings, max_message_bytes=2048))
    too_large = pb.EncodeRequest(texts=["a" * 1000] * 3)
    with srv.channel() as channel:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.EncoderServiceStub(channel).Encode(too_large, timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="a" * 3000), timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    registry = srv.server.metrics.registry
    assert counted(srv, "RESOURCE_EXHAUSTED") == (1 if grpc_front == "lean" else 0)
    timed = registry.get_sample_value("mhaserve_request_duration_seconds_count", {"method": ENCODE}) or 0
    assert timed == (1 if grpc_front == "lean" else 0)
    assert not [s for f in registry.collect() for s in f.samples if "Health" in s.labels.get("method", "")]


def test_a_method_the_server_has_not_is_unimplemented_and_counted_under_one_label(
    start: Start, settings: Settings
) -> None:
    """A call to a method no service here has was answered UNIMPLEMENTED and counted nowhere, where HTTP counts a
    request for no route under `(no route)` (a review's finding). One label for them all: the method's own would
    make a series of every name a client makes up."""
    srv = start(settings)
    with srv.channel() as channel:
        for method in ("/evil.Svc/M0", "/evil.Svc/M1", f"/{ENCODE.rsplit('/', 1)[0]}/Nope"):
            with pytest.raises(grpc.RpcError) as e:
                channel.unary_unary(method)(b"", timeout=WAIT)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, method
    assert counted(srv, "UNIMPLEMENTED", method="(no method)") == 3
    assert not [s for f in srv.server.metrics.registry.collect() for s in f.samples if "evil" in str(s.labels)]


def test_a_unary_call_sent_two_messages_is_refused_and_counted_on_the_lean_front(
    start: Start, settings: Settings, grpc_front: str
) -> None:
    """A cardinality violation (docs/grpc-fronts.md): the lean front answers UNIMPLEMENTED before the call's handler
    runs, counted under the method; grpc.aio's front answers the first message and drops the second."""
    srv = start(settings)
    one = ids([5]).SerializeToString()
    message = b"\x00" + len(one).to_bytes(4, "big") + one
    call = f.frame(f.HEADERS, f.END_HEADERS, 1, call_block(f"/{ENCODE}"))
    frames = raw_exchange(
        srv.server.port, call + f.frame(f.DATA, f.END_STREAM, 1, message * 2), until_closed=False, until=answered(1)
    )
    answer = answers(frames)[1]
    if grpc_front == "lean":
        assert answer["grpc-status"] == str(grpc.StatusCode.UNIMPLEMENTED.value[0]), answer
        assert (counted(srv, "UNIMPLEMENTED"), counted(srv, "OK")) == (1, 0)
    else:
        assert answer["grpc-status"] == "0", answer
        assert (counted(srv, "UNIMPLEMENTED"), counted(srv, "OK")) == (0, 1)


# The unary and server-streaming methods of each service the server has, as a call with no message names them.
ONE_MESSAGE = (
    ENCODE,
    "inference.GRPCInferenceService/ModelInfer",
    "tei.v1.Embed/Embed",
    "grpc.health.v1.Health/Watch",
)


def test_a_call_sent_no_message_is_refused_and_counted_on_the_lean_front(
    start: Start, settings: Settings, grpc_front: str
) -> None:
    """A cardinality violation (docs/grpc-fronts.md): a call to a method of any of the services that takes one
    request message, its client's side ended with none, is answered UNIMPLEMENTED on the lean front, counted under
    the method as the client's error (health is not counted, as ever); grpc.aio's front answers it only at its
    deadline. A stream of requests may be empty: EncodeStream with none is answered OK on both."""
    srv = start(settings)
    calls = [(2 * i + 1, path) for i, path in enumerate((*ONE_MESSAGE, "encoder.v1.EncoderService/EncodeStream"))]
    with socket.create_connection(("127.0.0.1", srv.server.port), timeout=10) as raw:
        raw.sendall(
            f.PREFACE
            + f.settings()
            + b"".join(
                f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, sid, call_block(f"/{path}", ("grpc-timeout", "300m")))
                for sid, path in calls
            )
        )
        # Every call's answer, however late grpc.aio's deadlines end them (no window of silence to outlast).
        frames = read_until(raw, lambda frames: {sid for sid, _ in calls} <= answers(frames).keys())
    got = answers(frames)
    *refused, (streamed, _) = calls
    assert got[streamed]["grpc-status"] == "0", got
    assert not [sid for kind, _, sid, _ in frames if kind == f.DATA and sid == streamed], "EncodeStream answered"
    expected = grpc.StatusCode.UNIMPLEMENTED if grpc_front == "lean" else grpc.StatusCode.DEADLINE_EXCEEDED
    for sid, path in refused:
        assert got[sid]["grpc-status"] == str(expected.value[0]), (path, got[sid])
        if grpc_front == "lean":
            assert "no request message" in got[sid]["grpc-message"], (path, got[sid])
    for path in ONE_MESSAGE[:3]:
        assert counted(srv, "UNIMPLEMENTED", path) == (1 if grpc_front == "lean" else 0), path
        assert counted(srv, "INVALID_ARGUMENT", path) == 0, path
    registry = srv.server.metrics.registry
    assert not [s for family in registry.collect() for s in family.samples if "Health" in s.labels.get("method", "")]


def test_full_queue_is_resource_exhausted_and_a_cancelled_call_frees_its_slot(start: Start, settings: Settings) -> None:
    engine = ScriptedEngine(hang_on=99)
    srv = start(
        dataclasses.replace(settings, max_queue_size=4, max_client_batch_size=4, max_wait_ms=0.0), engine.factory()
    )
    try:
        with srv.channel() as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            running = stub.Encode.future(ids([99]), timeout=WAIT)  # in the engine, holding it
            assert engine.hanging.wait(WAIT)
            three = stub.Encode.future(ids([5], [5], [5]), timeout=WAIT)
            doomed = stub.Encode.future(ids([66]), timeout=WAIT)
            wait_until(lambda: srv.depth() == 4, "4 inputs queued")
            with pytest.raises(grpc.RpcError) as e:
                stub.Encode(ids([7]), timeout=WAIT)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue is full (4 inputs waiting, limit 4)" in e.value.details()

            doomed.cancel()
            assert code_of(doomed) == grpc.StatusCode.CANCELLED
            wait_until(lambda: srv.depth() == 3, "the cancelled call's slot to be freed")
            wait_until(lambda: counted(srv, "CANCELLED") == 1, "the server to count the cancellation")
            late = stub.Encode.future(ids([8]), timeout=WAIT)  # fits again
            wait_until(lambda: srv.depth() == 4, "the late call queued")
            engine.release.set()
            assert [code_of(c) for c in (running, three, late)] == [grpc.StatusCode.OK] * 3
            assert len(three.result().embeddings) == 3
    finally:
        engine.release.set()
    assert not any(66 in row for batch in engine.batches for row in batch), "a cancelled request reached the model"
    assert counted(srv, "RESOURCE_EXHAUSTED") == 1


def test_deadline_exceeded_while_queued_never_reaches_the_model(start: Start, settings: Settings) -> None:
    engine = ScriptedEngine(hang_on=99)
    srv = start(dataclasses.replace(settings, max_wait_ms=0.0), engine.factory())
    try:
        with srv.channel() as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            running = stub.Encode.future(ids([99]), timeout=WAIT)
            assert engine.hanging.wait(WAIT)
            # The batch computes off the event loop: health and model info still answer meanwhile.
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=WAIT)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=WAIT).name == "tiny"
            with pytest.raises(grpc.RpcError) as e:
                stub.Encode(ids([55]), timeout=0.3)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_until(lambda: srv.depth() == 0, "the expired call's slot to be freed")
            wait_until(lambda: counted(srv, "DEADLINE_EXCEEDED") == 1, "the server to count the deadline")
            # and the model's series: grpc cancels the call at its deadline, which it counted as CANCELLED once
            by_model = srv.samples().get("mhaserve_model_requests_total", model="tiny", version="1", code="CANCELLED")
            assert by_model == 0
            assert (
                srv.samples().get("mhaserve_model_requests_total", model="tiny", version="1", code="DEADLINE_EXCEEDED")
                == 1
            )
            engine.release.set()
            assert code_of(running) == grpc.StatusCode.OK
            assert stub.Encode(ids([56]), timeout=WAIT).embeddings
    finally:
        engine.release.set()
    assert not any(55 in row for batch in engine.batches for row in batch)


def test_an_input_the_engine_fails_on_fails_only_its_own_request(start: Start, settings: Settings) -> None:
    """Its batch's neighbour is run again without it and answered (it failed with it before)."""
    engine = ScriptedEngine(fail_on=13, hang_on=99)
    srv = start(dataclasses.replace(settings, max_wait_ms=0.0), engine.factory())
    try:
        with srv.channel() as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            before = stub.Encode.future(ids([99, 5]), timeout=WAIT)  # batch 1, held
            assert engine.hanging.wait(WAIT)
            poisoned = stub.Encode.future(ids([13, 5]), timeout=WAIT)
            neighbour = ids([6, 5])
            neighbour.normalize = False
            beside = stub.Encode.future(neighbour, timeout=WAIT)
            wait_until(lambda: srv.depth() == 2, "both queued behind the held batch")
            engine.release.set()
            assert code_of(before) == grpc.StatusCode.OK
            with pytest.raises(grpc.RpcError) as e:
                poisoned.result(timeout=WAIT)
            assert e.value.code() == grpc.StatusCode.INTERNAL
            details = e.value.details()
            assert "inference on input 0 of this request failed (RuntimeError)" in details
            assert "Traceback" not in details and "injected" not in details and "\n" not in details
            assert vectors(beside.result(timeout=WAIT))[0].tolist() == [2, 6, 11, 1]
            # batch 2 held both, then each half alone
            assert sorted(engine.batches[-3]) == [[6, 5], [13, 5]]
            assert sorted(engine.batches[-2:]) == [[[6, 5]], [[13, 5]]]
            request = ids([7, 5])
            request.normalize = False
            after = stub.Encode(request, timeout=WAIT)  # the batcher goes on
            assert vectors(after)[0].tolist() == [2, 7, 12, 1]
    finally:
        engine.release.set()


def test_a_grpc_connection_that_sends_nothing_is_closed(start: Start, settings: Settings) -> None:
    """gRPC's own handshake deadline is 120 s: a few hundred silent connections (none, or only the HTTP/2
    preface) held every file descriptor. Now they get the HTTP port's header timeout."""
    srv = start(dataclasses.replace(settings, http_header_timeout=0.5), ScriptedEngine().factory())
    host, port = srv.address.rsplit(":", 1)
    for opening in (b"", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=WAIT) as s:
            s.sendall(opening)
            started = time.monotonic()
            with contextlib.suppress(ConnectionResetError):
                while s.recv(4096):
                    pass
            assert time.monotonic() - started < WAIT / 2, opening
    with srv.channel() as channel:  # and a client that speaks is served
        assert pb_grpc.EncoderServiceStub(channel).Encode(ids([5]), timeout=WAIT).embeddings


def test_health_and_unavailable_while_loading_and_draining(start: Start, settings: Settings) -> None:
    loaded = threading.Event()
    engine = ScriptedEngine()

    def slow_factory(entry):
        assert loaded.wait(WAIT)
        return engine

    srv = start(dataclasses.replace(settings, http_port=free_port()), slow_factory, ready=False)

    def http_refused(reason: str) -> None:
        reply = http.request("POST", srv.http_url + "/v1/embeddings", {"input": "a"})
        assert reply.status == 503 and reply.headers["retry-after"] == "1"
        assert reason in reply.json()["error"]["message"]
        health = http.request("GET", srv.http_url + "/health")
        assert health.status == 503 and health.json()["status"] == "NOT_SERVING"
        ready, live = (http.request("GET", srv.http_url + f"/v2/health/{probe}") for probe in ("ready", "live"))
        assert (ready.status, ready.json(), live.status, live.json()) == (400, {"ready": False}, 200, {"live": True})
        # the server's metadata describes the server, not the models: answered in every state, as Triton does
        assert http.request("GET", srv.http_url + "/v2").json()["name"] == "mhaserve"

    def metadata(channel: grpc.Channel) -> str:
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        return str(kserve.ServerMetadata(kpb.ServerMetadataRequest(), timeout=WAIT).name)

    with srv.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        stub = pb_grpc.EncoderServiceStub(channel)

        def status(service: str = "") -> str:
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

        def refused(call) -> str:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            return e.value.details()

        assert status() == status("encoder.v1.EncoderService") == status("tei.v1.Embed") == "NOT_SERVING"
        assert "still loading" in refused(lambda: stub.Encode(ids([5]), timeout=WAIT))
        http_refused("still loading")
        assert metadata(channel) == "mhaserve"
        loaded.set()
        srv.ready()
        assert status() == status("encoder.v1.EncoderService") == "SERVING"
        # TEI's services, as TEI started with an embedding model reports them: its classifier's and reranker's not
        served = ("inference.GRPCInferenceService", "tei.v1.Embed", "tei.v1.Info", "tei.v1.Tokenize")
        assert [status(name) for name in served] == ["SERVING"] * 4
        assert status("tei.v1.Predict") == status("tei.v1.Rerank") == "NOT_SERVING"
        # List (grpc.health.v1 since 2024): every service and its status, as Check says (it was UNIMPLEMENTED)
        listed = health.List(health_pb2.HealthListRequest(), timeout=WAIT).statuses
        assert listed[""].status == listed["encoder.v1.EncoderService"].status == health_pb2.HealthCheckResponse.SERVING
        assert stub.Encode(ids([5]), timeout=WAIT).embeddings
        assert http.request("GET", srv.http_url + "/health").status == 200

        srv.call(srv.server.drain())
        assert status() == status("encoder.v1.EncoderService") == "NOT_SERVING"
        assert [status(name) for name in served] == ["NOT_SERVING"] * 4
        assert "shutting down" in refused(lambda: stub.Encode(ids([5]), timeout=WAIT))
        assert "shutting down" in refused(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=WAIT))
        http_refused("shutting down")
        assert metadata(channel) == "mhaserve"
    assert counted(srv, "UNAVAILABLE") == 2


def test_a_watch_whose_client_reads_nothing_holds_up_no_change_of_health(start: Start, settings: Settings) -> None:
    """grpcio's Watch wrote each status holding the lock every change of status takes: one client whose HTTP/2
    window is 0 (it reads nothing; Watch is open without a key) held the health where it was, NOT_SERVING once
    the model loaded, and a SIGTERM's drain waited on it past --grace-period. Its watch now waits alone; a
    watcher that reads gets each status."""
    srv = start(settings)
    with socket.create_connection(("127.0.0.1", srv.server.port), timeout=WAIT) as raw, srv.channel() as channel:
        block = call_block("/grpc.health.v1.Health/Watch")
        raw.sendall(f.PREFACE + f.settings((f.INITIAL_WINDOW_SIZE, 0)) + f.frame(f.HEADERS, f.END_HEADERS, 1, block))
        raw.sendall(f.frame(f.DATA, f.END_STREAM, 1, bytes(5)))  # an empty HealthCheckRequest
        wait_until(lambda: srv.server.health.servicer.watching() == 1, "the watch that reads nothing")
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=WAIT)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        srv.call(srv.server.drain(), timeout=10)
        check = health.Check(health_pb2.HealthCheckRequest(), timeout=WAIT)
        assert check.status == next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()


def test_watches_past_the_bound_are_refused_and_those_ended_are_let_go(
    start: Start, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Watch (open without a key) had no bound but 1000 streams a connection times --max-connections: 40,000 held
    by a client with no key took the server's RSS up 300 MB and stalled its health checks for seconds. Past
    MAX_WATCHES a Watch is answered UNIMPLEMENTED at once, which gRPC clients' own health checking (gRFC A17, a
    Watch a channel) reads as "no health checking: healthy" (RESOURCE_EXHAUSTED, the first bound's answer, marked
    the replica unhealthy to every such client past the bound: one connection holding 1000 watches cut them all
    off); Check still answers, and the watches that end, cancelled or past their deadline, are let go."""
    monkeypatch.setattr(health_module, "MAX_WATCHES", 3)
    srv = start(settings)
    with srv.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=WAIT) for _ in range(3)]
        assert [next(w).status for w in watches] == [health_pb2.HealthCheckResponse.SERVING] * 3
        with pytest.raises(grpc.RpcError) as e:
            next(health.Watch(health_pb2.HealthCheckRequest(), timeout=WAIT))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "3 watches" in e.value.details() and "Check" in e.value.details()
        check = health.Check(health_pb2.HealthCheckRequest(), timeout=WAIT)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert srv.server.health.servicer.watching() == 3
        # a client that balances with health checking (its channel's Watch refused) still calls the replica
        config = {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}}
        with grpc.insecure_channel(srv.address, options=[("grpc.service_config", json.dumps(config))]) as checked:
            info = pb_grpc.EncoderServiceStub(checked).GetModelInfo(pb.GetModelInfoRequest(), timeout=WAIT)
            assert info.name

        for w in watches[:2]:
            w.cancel()
        expiring = health.Watch(health_pb2.HealthCheckRequest(), timeout=1.0)
        assert next(expiring).status == health_pb2.HealthCheckResponse.SERVING
        assert code_of(expiring) == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: srv.server.health.servicer.watching() == 1, "the ended watches to be let go")
        again = [health.Watch(health_pb2.HealthCheckRequest(), timeout=WAIT) for _ in range(2)]
        assert [next(w).status for w in again] == [health_pb2.HealthCheckResponse.SERVING] * 2
        for w in (watches[2], *again):
            w.cancel()
        wait_until(lambda: srv.server.health.servicer.watching() == 0, "the cancelled watches to be let go")


def test_watches_cancelled_before_their_first_write_log_no_error(
    start: Start, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """On grpc.aio's front a Watch cancelled before its first write logged `ERROR asyncio Task exception was never
    retrieved` (the write's ExecuteBatchError, in the task the drain runs a watch in): a client that cancels a
    Watch is ordinary, not the server's error. Its window of 0 holds each watch at its first write; the resets
    come together, as a client's cancels do."""
    srv = start(settings)
    streams = range(1, 41, 2)
    with socket.create_connection(("127.0.0.1", srv.server.port), timeout=WAIT) as raw:
        block = call_block("/grpc.health.v1.Health/Watch")
        raw.sendall(f.PREFACE + f.settings((f.INITIAL_WINDOW_SIZE, 0)))
        for s in streams:  # each an empty HealthCheckRequest
            raw.sendall(f.frame(f.HEADERS, f.END_HEADERS, s, block) + f.frame(f.DATA, f.END_STREAM, s, bytes(5)))
        wait_until(lambda: srv.server.health.servicer.watching() == len(streams), "the watches held at their write")
        raw.sendall(b"".join(f.rst_stream(s, 8) for s in streams))  # 8: CANCEL
        wait_until(lambda: srv.server.health.servicer.watching() == 0, "the cancelled watches to end")
    srv.call(asyncio.sleep(0.2))  # the handlers' last steps, on the server's loop
    gc.collect()  # a task whose exception was never retrieved says so as it is collected
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    with srv.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = health.Check(health_pb2.HealthCheckRequest(), timeout=WAIT)
        assert check.status == health_pb2.HealthCheckResponse.SERVING


def test_loading_wait_holds_calls_until_the_model_serves_within_deadlines(start: Start, settings: Settings) -> None:
    """--loading-wait: a call that comes while the model loads waits for it and is answered (gRPC and HTTP,
    as behind a balancer that sent it there before its health checks); one whose deadline comes first is
    refused UNAVAILABLE before that deadline."""
    loaded = threading.Event()
    engine = ScriptedEngine()

    def slow_factory(entry):
        assert loaded.wait(WAIT)
        return engine

    srv = start(dataclasses.replace(settings, http_port=free_port(), loading_wait=WAIT), slow_factory, ready=False)
    with srv.channel() as channel, ThreadPoolExecutor(2) as pool:
        stub = pb_grpc.EncoderServiceStub(channel)
        held = stub.Encode.future(ids([5]), timeout=WAIT)
        posted = pool.submit(http.request, "POST", srv.http_url + "/v1/embeddings", {"input": [[7, 5]]})
        # A short deadline: refused as still loading, not DEADLINE_EXCEEDED, and before the deadline.
        with pytest.raises(grpc.RpcError) as e:
            stub.Encode(ids([6]), timeout=1.0)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "still loading" in e.value.details()
        wait_until(lambda: srv.server.in_flight.count == 2, "the two held calls to be in flight", WAIT)
        assert not held.done() and not posted.done()
        loaded.set()
        srv.ready()
        assert vectors(held.result(timeout=WAIT)).shape[0] == 1
        reply = posted.result(timeout=WAIT)
        assert reply.status == 200 and len(reply.json()["data"]) == 1
    assert counted(srv, "OK") == 1 and counted(srv, "UNAVAILABLE") == 1


def test_a_drain_refuses_the_calls_held_for_a_loading_model(start: Start, settings: Settings) -> None:
    loaded = threading.Event()

    def slow_factory(entry):
        assert loaded.wait(WAIT)
        return ScriptedEngine()

    srv = start(dataclasses.replace(settings, loading_wait=WAIT), slow_factory, ready=False)
    try:
        with srv.channel() as channel:
            held = pb_grpc.EncoderServiceStub(channel).Encode.future(ids([5]), timeout=WAIT)
            wait_until(lambda: srv.server.in_flight.count == 1, "the call to be held", WAIT)
            srv.call_soon(srv.server.drain())
            with pytest.raises(grpc.RpcError) as e:
                held.result(timeout=WAIT)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
    finally:
        loaded.set()


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_the_services(server: ServerThread, version: str) -> None:
    # v1's messages are v1alpha's under another package (same fields and numbers): a v1 client sends
    # exactly these bytes to v1's method path.
    with server.channel() as channel:
        info = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="encoder.v1.EncoderService"),
        ]
        listed, described = list(info(iter(requests), timeout=WAIT))
    names = {s.name for s in listed.list_services_response.service}
    assert {
        "encoder.v1.EncoderService",
        "inference.GRPCInferenceService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    # What grpcurl needs to build requests without the .proto: the file descriptor of the service.
    files = [FileDescriptorProto.FromString(b) for b in described.file_descriptor_response.file_descriptor_proto]
    encoder = next(f for f in files if f.package == "encoder.v1")
    assert {m.name for m in encoder.service[0].method} == {"Encode", "EncodeStream", "GetModelInfo", "ListModels"}
    # `grpcurl describe` asks for each listed service's file and stops at the first it cannot have: v1
    # reflection's own was listed but not found once. A method's name finds its service's file (`grpcurl describe
    # encoder.v1.EncoderService.Encode`), which protobuf's descriptor pool alone does not do.
    symbols = [*sorted(names), "encoder.v1.EncoderService.Encode", "inference.GRPCInferenceService.ModelInfer"]
    symbols.append("encoder.v1.Nope.Encode")  # no such service: not found
    with server.channel() as channel:
        info = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        asked = (reflection_pb2.ServerReflectionRequest(file_containing_symbol=n) for n in symbols)
        *answers, unknown = list(info(asked, timeout=WAIT))
    assert unknown.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    for symbol, answer in zip(symbols[:-1], answers, strict=True):
        assert answer.WhichOneof("message_response") == "file_descriptor_response", (symbol, answer)
        files = [FileDescriptorProto.FromString(b) for b in answer.file_descriptor_response.file_descriptor_proto]
        service, method = (symbol, None) if symbol in names else symbol.rsplit(".", 1)
        package, name = service.rsplit(".", 1)
        found = next(s for f in files if f.package == package for s in f.service if s.name == name)
        assert method is None or method in {m.name for m in found.method}
        assert all(m.input_type.startswith(f".{package}.") for m in found.method), found  # v1's own types, say


def test_request_id_is_echoed(stub: pb_grpc.EncoderServiceStub) -> None:
    _, call = stub.Encode.with_call(
        pb.EncodeRequest(texts=["a"]), metadata=(("x-request-id", "abc-123"),), timeout=WAIT
    )
    assert ("x-request-id", "abc-123") in call.trailing_metadata()
    _, call = stub.Encode.with_call(pb.EncodeRequest(texts=["a"]), timeout=WAIT)
    generated = dict(call.trailing_metadata())["x-request-id"]
    assert len(generated) == 16
    with pytest.raises(grpc.RpcError) as e:
        stub.Encode(pb.EncodeRequest(), metadata=(("x-request-id", "bad-1"),), timeout=WAIT)
    assert ("x-request-id", "bad-1") in e.value.trailing_metadata()


def test_an_error_leaves_the_clients_retry_policy_free_to_retry(start: Start, settings: Settings) -> None:
    """A gRPC client retries a call (deploy/clients/: UNAVAILABLE from a draining replica) only while nothing of
    the answer has come: an error must be a trailers-only response. Sent with the handler's return instead of
    `context.abort`, it came after response headers, and the clients behind nginx saw a draining replica's
    UNAVAILABLE that their policy would have retried (tests/deploy/test_loadbalancer.py)."""
    srv = start(settings, ScriptedEngine().factory())
    config = (
        '{"methodConfig": [{"name": [{"service": "encoder.v1.EncoderService"}], "retryPolicy": {"maxAttempts": 3, '
        '"initialBackoff": "0.01s", "maxBackoff": "0.05s", "backoffMultiplier": 2, '
        '"retryableStatusCodes": ["INVALID_ARGUMENT"]}}]}'
    )
    before = srv.counted("INVALID_ARGUMENT")
    options = [("grpc.enable_retries", 1), ("grpc.service_config", config)]
    with grpc.insecure_channel(srv.address, options=options) as channel, pytest.raises(grpc.RpcError) as e:
        pb_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(), timeout=WAIT)  # no inputs
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_until(lambda: srv.counted("INVALID_ARGUMENT") - before == 3, "the client's two retries to be answered")


def test_the_metrics_port_listens_where_told_and_drops_silent_connections(
    start: Start, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--metrics-host (docs/security.md said to bind metrics to a private address; nothing let one), and a
    connection that sends nothing is closed (prometheus_client's server kept each, a thread apiece)."""
    from mhaserve.service import metrics

    monkeypatch.setattr(metrics._Handler, "timeout", 0.5)
    port = free_port()
    srv = start(dataclasses.replace(settings, metrics_port=port, metrics_host="127.0.0.2"), ScriptedEngine().factory())
    assert srv.server.metrics_port == port
    assert scrape(port, host="127.0.0.2").get("mhaserve_requests_in_flight") == 0
    with pytest.raises(OSError):
        scrape(port, host="127.0.0.1")  # not on --host's address
    with socket.create_connection(("127.0.0.2", port), timeout=WAIT) as s:
        started = time.monotonic()
        assert s.recv(1) == b""
        assert time.monotonic() - started < WAIT / 2
    assert scrape(port, host="127.0.0.2").get("mhaserve_requests_in_flight") == 0


def test_metrics_move_as_requests_are_served(server: ServerThread) -> None:
    port = server.server.metrics_port
    assert port
    # The module's server has served the tests before this one, and counts a call only after its status is
    # sent (then takes it off the in-flight gauge): wait until the last of those is counted, or it is counted
    # between the two scrapes (a fresh clone's run once counted the previous test's INVALID_ARGUMENT here).
    wait_until(lambda: scrape(port).get("mhaserve_requests_in_flight") == 0, "earlier calls to be counted")
    before = scrape(port)
    with server.channel() as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        stub.Encode(pb.EncodeRequest(texts=["one", "two words", "three words here"]), timeout=WAIT)
        with pytest.raises(grpc.RpcError):
            stub.Encode(pb.EncodeRequest(), timeout=WAIT)
    # The interceptor counts a call after its status is sent, so a scrape right away can miss the last one.
    duration = "mhaserve_request_duration_seconds_count"
    wait_until(
        lambda: scrape(port).get(duration, method=ENCODE) - before.get(duration, method=ENCODE) >= 2,
        "both calls to be counted",
    )
    after = scrape(port)

    def delta(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    assert delta("mhaserve_requests_total", code="OK", method=ENCODE) == 1
    assert delta("mhaserve_requests_total", code="INVALID_ARGUMENT", method=ENCODE) == 1
    assert delta(duration, method=ENCODE) == 2
    assert delta("mhaserve_inputs_total") == 3
    assert delta("mhaserve_tokenize_duration_seconds_count") == 1
    assert delta("mhaserve_queue_wait_seconds_count") == 1
    for name in ("inference_duration_seconds", "batch_size", "batch_tokens", "padding_fraction"):
        assert delta(f"mhaserve_{name}_count") >= 1, name
    assert delta("mhaserve_batch_size_sum") == 3
    assert after.get("mhaserve_queue_depth") == 0
    assert after.get("mhaserve_requests_in_flight") == 0
    assert after.get("mhaserve_execution_provider_info", provider="CPUExecutionProvider") == 1


def test_packed_output_is_the_same_vectors(stub: pb_grpc.EncoderServiceStub) -> None:
    texts = ["one", "two words", "three words here"]
    plain = stub.Encode(pb.EncodeRequest(texts=texts), timeout=WAIT)
    packed = stub.Encode(pb.EncodeRequest(texts=texts, packed=True), timeout=WAIT)
    assert not packed.embeddings and packed.dimensions == 32 and len(packed.packed) == 3 * 32 * 4
    np.testing.assert_array_equal(client.vectors(packed), client.vectors(plain))
    assert client.vectors(plain).shape == (3, 32)
    assert (packed.model, packed.model_version, packed.usage) == (plain.model, plain.model_version, plain.usage)


def test_dimensions_keep_the_leading_values_renormalised(stub: pb_grpc.EncoderServiceStub) -> None:
    """encoder.v1's `dimensions`, as the OpenAI route's: the first values of each embedding, L2-normalised."""
    texts = ["one", "two words"]
    full = client.vectors(stub.Encode(pb.EncodeRequest(texts=texts, normalize=False), timeout=WAIT))
    for d in (1, 8, 32):
        cut = client.vectors(stub.Encode(pb.EncodeRequest(texts=texts, dimensions=d, packed=d == 8), timeout=WAIT))
        expected = full[:, :d] / np.linalg.norm(full[:, :d], axis=1, keepdims=True)
        np.testing.assert_allclose(cut, expected, atol=1e-6)
    for bad in (0, 33):
        with pytest.raises(grpc.RpcError) as e:
            stub.Encode(pb.EncodeRequest(texts=texts, dimensions=bad), timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"dimensions is {bad}" in str(e.value.details())
    # normalize false: the leading values as they are, as TEI answers them (a 400 until 2026-12-07); true as unset
    cut = client.vectors(stub.Encode(pb.EncodeRequest(texts=texts, dimensions=8, normalize=False), timeout=WAIT))
    np.testing.assert_array_equal(cut, full[:, :8])
    unit = client.vectors(stub.Encode(pb.EncodeRequest(texts=texts, dimensions=8, normalize=True), timeout=WAIT))
    np.testing.assert_allclose(unit, full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True), atol=1e-6)


def test_once_stopped_serve_lets_the_calls_still_running_finish_before_the_loop_closes() -> None:
    """gRPC may hand over a call as it stops; the gate refuses it at once, but only if the loop runs it.
    Cancelled by asyncio.run's close instead, gRPC logs it as an unhandled error with a traceback (seen once
    in a full run of the suite). settle gives such tasks their turn, bounded for one that never ends."""

    async def scenario() -> tuple[bool, bool]:
        answered = asyncio.ensure_future(asyncio.sleep(0.05))  # a call refused a moment after the stop
        await server_module.settle(5.0)
        finished = answered.done() and not answered.cancelled()
        forever = asyncio.ensure_future(asyncio.Event().wait())
        t0 = asyncio.get_running_loop().time()
        await server_module.settle(0.1)  # bounded: returns with the task still waiting
        bounded = not forever.done() and asyncio.get_running_loop().time() - t0 < 2.0
        forever.cancel()
        return finished, bounded

    assert asyncio.run(scenario()) == (True, True)
    asyncio.run(server_module.settle(5.0))  # nothing left: returns at once


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_host_serves_grpc_http_and_metrics(
    tiny_repo: Path, host: str, grpc_front: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`--host ::` could not listen (grpc's address was not bracketed) and `--host [::]` could not serve
    metrics (getaddrinfo was given the brackets): an IPv6-only cluster could not run the server. Its log
    lines write the address as a URL does ("listening on :::50051" read as nothing)."""
    from mhaserve.testing.server import local_settings

    caplog.set_level("INFO", logger="mhaserve.service")
    settings = local_settings(tiny_repo, host=host, grpc_front=grpc_front)
    with ServerThread(settings) as srv:
        srv.ready()
        said = " | ".join(r.getMessage() for r in caplog.records)
        assert f"listening on [::1]:{srv.server.port}," in said and f"HTTP on [::1]:{srv.server.http_port}," in said
        assert f"metrics on http://[::1]:{settings.metrics_port}/metrics" in said
        with grpc.insecure_channel(f"[::1]:{srv.server.port}") as channel:
            reply = pb_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(texts=["over IPv6"]), timeout=WAIT)
            assert len(reply.embeddings) == 1
        assert http.request("GET", f"http://[::1]:{srv.server.http_port}/health").status == 200
        assert http.request("GET", f"http://[::1]:{settings.metrics_port}/metrics").status == 200
    assert server_module.grpc_address("0.0.0.0", 1) == "0.0.0.0:1"
    assert server_module.grpc_address("::", 1) == server_module.grpc_address("[::]", 1) == "[::]:1"


def test_max_connection_age_sends_clients_away_to_connect_again(tiny_repo: Path, grpc_front: str) -> None:
    """A gRPC connection stayed with its replica for good, through a Kubernetes Service or a headless one:
    replicas the autoscaler added got none of the clients already connected."""
    states: list[grpc.ChannelConnectivity] = []
    with ServerThread(bare_settings(tiny_repo, "tiny", max_connection_age=0.5, grpc_front=grpc_front)) as srv:
        srv.ready()
        with srv.channel() as channel:
            channel.subscribe(states.append, try_to_connect=False)
            stub = pb_grpc.EncoderServiceStub(channel)
            assert len(stub.Encode(pb.EncodeRequest(texts=["a"]), timeout=WAIT).embeddings) == 1
            # the GOAWAY: the channel goes idle after being READY (the callbacks come on grpc's own thread, late:
            # the first, IDLE before connecting, must not pass for it), and its next call connects again
            wait_until(
                lambda: grpc.ChannelConnectivity.READY in states and states[-1] == grpc.ChannelConnectivity.IDLE,
                "the connection's GOAWAY",
                10,
            )
            assert len(stub.Encode(pb.EncodeRequest(texts=["b"]), timeout=WAIT).embeddings) == 1
            wait_until(lambda: states.count(grpc.ChannelConnectivity.READY) >= 2, "a second connection", 10)


def test_the_metrics_port_closes_off_the_event_loop(tiny_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its HTTP server's shutdown waits for the serving thread's next poll, up to half a second: on the event
    loop, that blocked it, and a second SIGTERM or Ctrl-C sent meanwhile was never handled (the process exited
    0, not 143 or 130)."""
    where: list[str] = []
    close = Metrics.close

    def recording(self: Metrics) -> None:
        try:
            asyncio.get_running_loop()
            where.append("the event loop")
        except RuntimeError:
            where.append("a thread")
        close(self)

    monkeypatch.setattr(Metrics, "close", recording)
    with ServerThread(bare_settings(tiny_repo, "tiny", metrics_port=free_port())) as srv:
        srv.ready()
    assert where == ["a thread"]


def test_a_call_that_outlives_its_connections_age_ends_with_its_own_status(tiny_repo: Path, grpc_front: str) -> None:
    """The last call on a connection sent away (its age, or a drain) ends OK at the client. On the lean front the
    connection's end went out before the call's trailers, which were then dropped: the client read every
    answer, then UNAVAILABLE "Socket closed", for a call the server counted OK."""
    n = 4

    def slowly() -> Iterator[pb.EncodeRequest]:
        for i in range(n):
            yield pb.EncodeRequest(texts=[f"text {i}"])
            time.sleep(0.3)  # 4 messages over 1.2 s: the age of 0.5 s passes while the call is open

    with ServerThread(bare_settings(tiny_repo, "tiny", max_connection_age=0.5, grpc_front=grpc_front)) as srv:
        srv.ready()
        with srv.channel() as channel:
            call = pb_grpc.EncoderServiceStub(channel).EncodeStream(slowly(), timeout=WAIT)
            assert [len(reply.embeddings) for reply in call] == [1] * n
            assert call.code() == grpc.StatusCode.OK


CALL_MIXES = int(os.environ.get("CALL_MIXES", "40"))  # examples a run (each front); more by hand
CALL_WAIT = float(os.environ.get("CALL_WAIT", "20"))  # seconds before a call that has not ended is a failure


# ---- random concurrent calls: whatever their mix, each ends as it should and nothing is left in flight ---------

_CALLS = st.tuples(
    st.sampled_from(["good", "good", "invalid", "unknown", "stream", "stream"]),
    st.sampled_from([None, None, 0.001, 0.05]),  # deadline, s
    st.sampled_from([None, None, 0.0, 0.002, 0.02]),  # cancelled after, s
    st.integers(1, 4),  # a stream's messages
)


@hsettings(max_examples=CALL_MIXES, deadline=None, suppress_health_check=list(HealthCheck))
@given(calls=st.lists(_CALLS, min_size=1, max_size=12))
def test_random_concurrent_calls_end_as_they_should_and_leave_nothing_in_flight(
    server: ServerThread, calls: list[tuple[str, float | None, float | None, int]]
) -> None:
    """Unary calls (good, invalid, of an unknown model; grpc.aio's client) and EncodeStream calls (grpcio's
    synchronous client), all at once, some with deadlines of a millisecond or more, some cancelled at any
    point: each ends OK with its vectors, or
    with its own error, DEADLINE_EXCEEDED only where it had a deadline, CANCELLED only where it was
    cancelled; afterwards nothing is counted in flight and the server answers as before (both fronts)."""

    def stream(stub: pb_grpc.EncoderServiceStub, deadline: float | None, cancel: float | None, n: int) -> str:
        """EncodeStream from grpcio's synchronous client, in a thread: grpc.aio's client mishandles a stream
        call that ends early, whatever the server (a write after it ends raises grpc's ExecuteBatchError or
        reads INTERNAL "Internal error from Core", grpc/grpc#36066; a write after an early cancel waits for
        ever), and those are not what this test is after."""
        call = stub.EncodeStream(
            iter([pb.EncodeRequest(texts=[f"text {i}"], model="tiny") for i in range(n)]), timeout=deadline
        )
        timer = threading.Timer(cancel, call.cancel) if cancel is not None else None
        if timer is not None:
            timer.start()
        try:
            assert [len(r.embeddings) for r in call] == [1] * n
        except grpc.RpcError:
            pass  # its status says how it ended
        finally:
            if timer is not None:
                timer.join()
        return str(call.code().name)

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            sync = pb_grpc.EncoderServiceStub(sync_channel)

            async def one(kind: str, deadline: float | None, cancel: float | None, n: int) -> str:
                if kind == "stream":
                    return await asyncio.to_thread(stream, sync, deadline, cancel, n)
                request = {
                    "good": pb.EncodeRequest(texts=["a text", "another"], model="tiny"),
                    "invalid": pb.EncodeRequest(texts=["a"], token_ids=[pb.TokenIds(ids=[1, 2])], model="tiny"),
                    "unknown": pb.EncodeRequest(texts=["a"], model="nope"),
                }[kind]
                call = stub.Encode(request, timeout=deadline)
                if cancel is not None:
                    asyncio.get_running_loop().call_later(cancel, call.cancel)
                try:
                    answer = await call
                    assert [len(e.values) for e in answer.embeddings] == [TINY["d_model"]] * 2
                except (asyncio.CancelledError, grpc.aio.AioRpcError):
                    pass  # its status says how it ended
                return str((await call.code()).name)

            tasks = [asyncio.ensure_future(one(*c)) for c in calls]
            _, pending = await asyncio.wait(tasks, timeout=CALL_WAIT)
            assert not pending, f"calls never ended: {[c for c, t in zip(calls, tasks, strict=True) if t in pending]}"
            ended = [t.result() for t in tasks]
            for (kind, deadline, cancel, _), code in zip(calls, ended, strict=True):
                allowed = {"good": {"OK"}, "stream": {"OK"}, "invalid": {"INVALID_ARGUMENT"}, "unknown": {"NOT_FOUND"}}
                expected = set(allowed[kind])
                if deadline is not None:
                    expected.add("DEADLINE_EXCEEDED")
                if cancel is not None:
                    expected.add("CANCELLED")
                assert code in expected, (kind, deadline, cancel, code)

    with grpc.insecure_channel(server.address) as sync_channel:
        asyncio.run(main())
    port = server.server.metrics_port
    assert port
    wait_until(lambda: scrape(port).get("mhaserve_requests_in_flight") == 0, "no call left in flight")
    with grpc.insecure_channel(server.address) as channel:
        answer = pb_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(texts=["still here"], model="tiny"))
        assert len(answer.embeddings) == 1


_ENCODE_REQUESTS = st.builds(
    pb.EncodeRequest,
    texts=st.lists(st.text(max_size=30), max_size=4),
    token_ids=st.lists(
        st.builds(pb.TokenIds, ids=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 40), max_size=40)),
        max_size=3,
    ),
    model=st.sampled_from(["", "tiny", "tiny:1", "tiny:2", "tiny:", ":1", "tiny:x", "nope", "tiny:1:1"]),
    truncate=st.none() | st.booleans(),
    normalize=st.none() | st.booleans(),
    model_version=st.sampled_from([0, 1, 2, -1, 2**63 - 1]),
    prompt_name=st.sampled_from(["", "query", "x"]),
    packed=st.booleans(),
    dimensions=st.none() | st.sampled_from([-1, 0, 1, 16, 32, 33, 2**31 - 1]),
)


@hsettings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=_ENCODE_REQUESTS)
def test_arbitrary_encode_requests_are_answered_or_refused_never_failed(
    stub: pb_grpc.EncoderServiceStub, request: pb.EncodeRequest
) -> None:
    """Any combination of Encode's fields: answered with a vector a row, or refused with a status that says
    what was wrong with the request (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED); never INTERNAL or
    UNKNOWN."""
    try:
        reply = stub.Encode(request, timeout=WAIT)
    except grpc.RpcError as e:
        assert e.code() in REFUSALS, (e.code(), e.details(), request)
        return
    rows = len(request.texts) or len(request.token_ids)
    assert (reply.dimensions and len(reply.packed) == 4 * rows * reply.dimensions) or len(reply.embeddings) == rows
