"""text-embeddings-inference's gRPC API (tei.v1) against a real mhaserve, on both gRPC fronts, through stubs made
from the tei.v1 proto as TEI's gRPC clients make theirs: the vectors are encoder.v1's, the tokens and texts are
TEI's HTTP routes', streams answer in order and end at a failed request, what is not served says so, and the
server answers as usual after every refusal."""

from __future__ import annotations

import dataclasses
import io
import json
import queue
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
from google.protobuf import descriptor_pool
from google.protobuf.descriptor_pb2 import FileDescriptorProto, FileDescriptorSet
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from mhaserve.export.publish import ExportOptions, export_entry
from mhaserve.model.config import TINY
from mhaserve.proto.encoder.v1 import encoder_pb2 as epb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as epb_grpc
from mhaserve.proto.tei.v1 import tei_pb2 as pb
from mhaserve.proto.tei.v1 import tei_pb2_grpc as pb_grpc
from mhaserve.testing.http import request
from mhaserve.testing.loopback import WAIT, wait_until
from mhaserve.testing.metrics import scrape
from mhaserve.testing.server import ServerThread, local_settings
from tests.kserve.triton_client import describe_file

TEXTS = ["hello world", "a", "héllo wörld 🤖", "the quick brown fox jumps over the lazy dog " * 3]


@pytest.fixture(scope="module")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with server.channel() as channel:
        yield channel


def encode(channel: grpc.Channel, texts: list[str], **fields: Any) -> npt.NDArray[np.float32]:
    reply = epb_grpc.EncoderServiceStub(channel).Encode(epb.EncodeRequest(texts=texts, **fields), timeout=WAIT)
    return np.array([e.values for e in reply.embeddings], dtype=np.float32)


def refused(call: Any, *args: Any, **kw: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        result = call(*args, timeout=WAIT, **kw)
        if hasattr(result, "__iter__"):  # a stream of responses (a message is not iterable)
            list(result)
    return e.value


def test_embed_gives_encodes_vectors(channel: grpc.Channel) -> None:
    """Normalised unless asked otherwise, as TEI's; `dimensions` keeps the leading values renormalised; a long
    text is cut with `truncate`; the metadata counts the text's characters and tokens, and gives the call's time
    in the server and where it went, within it."""
    stub = pb_grpc.EmbedStub(channel)
    expected = encode(channel, TEXTS, normalize=True)
    for text, vector in zip(TEXTS, expected, strict=True):
        reply = stub.Embed(pb.EmbedRequest(inputs=text), timeout=WAIT)
        np.testing.assert_allclose(reply.embeddings, vector, rtol=0, atol=1e-6)  # alone, against in a batch
        tokens = pb_grpc.TokenizeStub(channel).Tokenize(pb.EncodeRequest(inputs=text, add_special_tokens=True))
        assert reply.metadata.compute_tokens == len(tokens.tokens)
        assert reply.metadata.compute_chars == len(text)
        meta = reply.metadata
        assert meta.tokenization_time_ns > 0 and meta.inference_time_ns > 0 and meta.queue_time_ns >= 0
        assert meta.tokenization_time_ns + meta.queue_time_ns + meta.inference_time_ns < meta.total_time_ns
    raw = stub.Embed(pb.EmbedRequest(inputs=TEXTS[0], normalize=False), timeout=WAIT)
    np.testing.assert_allclose(raw.embeddings, encode(channel, TEXTS[:1], normalize=False)[0], rtol=0, atol=1e-6)
    cut = np.asarray(stub.Embed(pb.EmbedRequest(inputs=TEXTS[0], dimensions=8), timeout=WAIT).embeddings)
    np.testing.assert_allclose(cut, expected[0, :8] / np.linalg.norm(expected[0, :8]), atol=1e-6)
    long = "word " * 400
    truncated = stub.Embed(pb.EmbedRequest(inputs=long, truncate=True), timeout=WAIT)
    np.testing.assert_allclose(truncated.embeddings, encode(channel, [long], truncate=True)[0], rtol=0, atol=1e-6)
    assert truncated.metadata.compute_tokens == 160
    # --auto-truncate is on by default; a false truncate is an unset one in proto3, the server's choice
    default = stub.Embed(pb.EmbedRequest(inputs=long), timeout=WAIT)
    np.testing.assert_array_equal(default.embeddings, truncated.embeddings)


def test_a_unary_embed_carries_teis_timing_headers(channel: grpc.Channel) -> None:
    """As TEI's: the answer's Metadata again, as initial metadata in TEI's HTTP headers' names and whole
    milliseconds; a stream's answers, which share one set of headers, carry none."""
    reply, call = pb_grpc.EmbedStub(channel).Embed.with_call(pb.EmbedRequest(inputs=TEXTS[2]), timeout=WAIT)
    headers, meta = dict(call.initial_metadata()), reply.metadata
    assert int(headers["x-compute-characters"]) == meta.compute_chars == len(TEXTS[2])
    assert int(headers["x-compute-tokens"]) == meta.compute_tokens
    assert int(headers["x-total-time"]) == int(headers["x-compute-time"]) == meta.total_time_ns // 1_000_000
    for name, ns in (
        ("x-tokenization-time", meta.tokenization_time_ns),
        ("x-queue-time", meta.queue_time_ns),
        ("x-inference-time", meta.inference_time_ns),
    ):
        assert int(headers[name]) == ns // 1_000_000, name
    stream = pb_grpc.EmbedStub(channel).EmbedStream(iter([pb.EmbedRequest(inputs="a")]), timeout=WAIT)
    assert len(list(stream)) == 1 and "x-total-time" not in dict(stream.initial_metadata())


def test_embed_stream_answers_in_order_and_a_failed_request_ends_it(channel: grpc.Channel) -> None:
    stub = pb_grpc.EmbedStub(channel)
    texts = [f"text number {i}" for i in range(40)]  # more than the stream's window
    replies = list(stub.EmbedStream(iter(pb.EmbedRequest(inputs=t) for t in texts), timeout=WAIT))
    expected = np.vstack([encode(channel, texts[i : i + 8], normalize=True) for i in range(0, 40, 8)])
    np.testing.assert_allclose([r.embeddings for r in replies], expected, rtol=0, atol=1e-6)
    # TEI's responses carry no error: a request that fails ends the stream with its status, after the answers
    # to the requests before it.
    bad = pb.EmbedRequest(inputs="word", dimensions=33)
    requests = [pb.EmbedRequest(inputs="fine"), bad, pb.EmbedRequest(inputs="x")]
    call = stub.EmbedStream(iter(requests), timeout=WAIT)
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for reply in call:
            got.append(reply)
    assert len(got) == 1
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "embeddings have 32" in (e.value.details() or "")


def test_truncation_direction_left_keeps_a_long_texts_end(channel: grpc.Channel) -> None:
    """LEFT (refused here before) cuts a long text's start, as TEI's HTTP routes here cut it; RIGHT its end."""
    stub = pb_grpc.EmbedStub(channel)
    text = "alpha beta gamma " * 60 + "the end of a long text, which is what the left truncation keeps"
    cut_start = pb.EmbedRequest(inputs=text, truncate=True, truncation_direction=pb.TRUNCATION_DIRECTION_LEFT)
    left = stub.Embed(cut_start, timeout=WAIT)
    right = stub.Embed(pb.EmbedRequest(inputs=text, truncate=True), timeout=WAIT)
    assert left.metadata.compute_tokens == right.metadata.compute_tokens == 160
    asked = pb.EncodeRequest(inputs=text, add_special_tokens=True)
    whole = [t.id for t in pb_grpc.TokenizeStub(channel).Tokenize(asked, timeout=WAIT).tokens]
    assert len(whole) > 160  # tokenised whole, special tokens at both ends
    kept = [epb.TokenIds(ids=[whole[0], *whole[1:-1][-158:], whole[-1]])]
    reply = epb_grpc.EncoderServiceStub(channel).Encode(epb.EncodeRequest(token_ids=kept, normalize=True), timeout=WAIT)
    np.testing.assert_allclose(left.embeddings, reply.embeddings[0].values, rtol=0, atol=1e-6)
    np.testing.assert_allclose(right.embeddings, encode(channel, [text], normalize=True)[0], rtol=0, atol=1e-6)
    assert not np.allclose(left.embeddings, right.embeddings, atol=1e-3)


def test_no_auto_truncate_refuses_a_long_text(start: Any, settings: Any) -> None:
    """tei.v1's truncate is a proto3 bool: false is unset, and the server's --no-auto-truncate refuses."""
    with start(dataclasses.replace(settings, auto_truncate=False)).channel() as channel:
        stub, long = pb_grpc.EmbedStub(channel), "word " * 400
        with pytest.raises(grpc.RpcError) as e:
            stub.Embed(pb.EmbedRequest(inputs=long), timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "1602 tokens long, more than the model's maximum of 160" in (e.value.details() or "")
        assert stub.Embed(pb.EmbedRequest(inputs=long, truncate=True), timeout=WAIT).metadata.compute_tokens == 160


@pytest.mark.parametrize(
    ("embed", "code", "message"),
    [
        (pb.EmbedRequest(inputs=""), grpc.StatusCode.INVALID_ARGUMENT, "inputs is an empty string"),
        (pb.EmbedRequest(inputs="a", dimensions=33), grpc.StatusCode.INVALID_ARGUMENT, "embeddings have 32"),
        (pb.EmbedRequest(inputs="a", prompt_name="query"), grpc.StatusCode.INVALID_ARGUMENT, "no prompt 'query'"),
        # a number the enum does not name was served as RIGHT; TEI's own server fails the call, and TEI's HTTP
        # routes here refuse "middle" with a 400
        (
            pb.EmbedRequest(inputs="a", truncation_direction=7),  # type: ignore[arg-type]
            grpc.StatusCode.INVALID_ARGUMENT,
            "truncation_direction 7 is none of TRUNCATION_DIRECTION_RIGHT (0) and TRUNCATION_DIRECTION_LEFT (1)",
        ),
    ],
)
def test_bad_embed_requests_are_refused_saying_why(
    channel: grpc.Channel, embed: pb.EmbedRequest, code: grpc.StatusCode, message: str
) -> None:
    stub = pb_grpc.EmbedStub(channel)
    error = refused(stub.Embed, embed)
    assert error.code() == code and message in (error.details() or ""), error
    assert len(stub.Embed(pb.EmbedRequest(inputs="still here"), timeout=WAIT).embeddings) == 32


def test_the_model_metadata_names_a_served_model(channel: grpc.Channel) -> None:
    """TEI serves one model; here the `model` metadata names one of the served (name, or name:version)."""
    stub = pb_grpc.EmbedStub(channel)
    named = stub.Embed(pb.EmbedRequest(inputs="hello"), metadata=(("model", "tiny:1"),), timeout=WAIT)
    np.testing.assert_allclose(named.embeddings, encode(channel, ["hello"], normalize=True)[0], rtol=0, atol=1e-6)
    error = refused(stub.Embed, pb.EmbedRequest(inputs="hello"), metadata=(("model", "nope"),))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "model 'nope' is not served here" in (error.details() or "")
    info = refused(pb_grpc.InfoStub(channel).Info, pb.InfoRequest(), metadata=(("model", "nope"),))
    assert info.code() == grpc.StatusCode.NOT_FOUND


def test_info_says_what_is_served(server: ServerThread, channel: grpc.Channel) -> None:
    info = pb_grpc.InfoStub(channel).Info(pb.InfoRequest(), timeout=WAIT)
    http = request("GET", server.http_url + "/info").json()
    assert info.model_type == pb.MODEL_TYPE_EMBEDDING
    assert info.model_id == http["source"] and info.model_sha == http["sha256"]
    assert info.model_dtype == "float32"
    assert info.max_input_length == http["max_input_length"] == 160
    assert info.max_client_batch_size == http["limits"]["max_client_batch_size"] == 8
    assert info.max_batch_tokens == http["limits"]["max_batch_tokens"]
    assert info.max_concurrent_requests == http["limits"]["max_queue_size"]
    assert info.version == http["server"]["version"]
    # the threads that tokenise what is not tokenised on the event loop, as TEI's field counts its own
    assert info.tokenization_workers == http["tokenization_workers"] == 2


def test_tokenize_and_decode_answer_as_teis_http_routes(server: ServerThread, channel: grpc.Channel) -> None:
    stub = pb_grpc.TokenizeStub(channel)
    for text in TEXTS:
        for special in (True, False):
            reply = stub.Tokenize(pb.EncodeRequest(inputs=text, add_special_tokens=special), timeout=WAIT)
            body: dict[str, Any] = {"inputs": text, "add_special_tokens": special}
            (http,) = request("POST", server.http_url + "/tokenize", body).json()
            ours = [
                {
                    "id": t.id,
                    "text": t.text,
                    "special": t.special,
                    "start": t.start if t.HasField("start") else None,
                    "stop": t.stop if t.HasField("stop") else None,
                }
                for t in reply.tokens
            ]
            assert ours == http
            ids = [t.id for t in reply.tokens]
            for skip in (True, False):
                decoded = stub.Decode(pb.DecodeRequest(ids=ids, skip_special_tokens=skip), timeout=WAIT).text
                body = {"ids": ids, "skip_special_tokens": skip}
                assert [decoded] == request("POST", server.http_url + "/decode", body).json()
    streamed = list(stub.TokenizeStream(iter(pb.EncodeRequest(inputs=t) for t in TEXTS), timeout=WAIT))
    assert [[t.id for t in r.tokens] for r in streamed] == [
        [t.id for t in stub.Tokenize(pb.EncodeRequest(inputs=t), timeout=WAIT).tokens] for t in TEXTS
    ]
    decoded = list(stub.DecodeStream(iter(pb.DecodeRequest(ids=[40, 41]) for _ in range(3)), timeout=WAIT))
    assert [d.text for d in decoded] == [stub.Decode(pb.DecodeRequest(ids=[40, 41]), timeout=WAIT).text] * 3
    error = refused(stub.Decode, pb.DecodeRequest(ids=[2, 300]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in (error.details() or "")
    # every token of a text past the model's maximum, as TEI gives them; refused past 250 characters a token
    assert len(stub.Tokenize(pb.EncodeRequest(inputs="word " * 400), timeout=WAIT).tokens) == 4 * 400
    error = refused(stub.Tokenize, pb.EncodeRequest(inputs="w" * (160 * 250 + 1)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "40001 characters long" in (error.details() or "")
    assert (error.details() or "").endswith("does): shorten it")  # tei.v1's Tokenize has no truncate to set


def test_what_is_not_served_is_unimplemented_saying_so(channel: grpc.Channel) -> None:
    embed, predict, rerank = pb_grpc.EmbedStub(channel), pb_grpc.PredictStub(channel), pb_grpc.RerankStub(channel)
    calls = [
        (embed.EmbedSparse, pb.EmbedSparseRequest(inputs="a"), "EmbedSparse"),
        (embed.EmbedAll, pb.EmbedAllRequest(inputs="a"), "EmbedAll"),
        (embed.EmbedSparseStream, iter([pb.EmbedSparseRequest(inputs="a")]), "EmbedSparseStream"),
        (embed.EmbedAllStream, iter([pb.EmbedAllRequest(inputs="a")]), "EmbedAllStream"),
        (predict.Predict, pb.PredictRequest(inputs="a"), "Predict"),
        (predict.PredictPair, pb.PredictPairRequest(inputs=["a", "b"]), "PredictPair"),
        (predict.PredictStream, iter([pb.PredictRequest(inputs="a")]), "PredictStream"),
        (predict.PredictPairStream, iter([pb.PredictPairRequest(inputs=["a", "b"])]), "PredictPairStream"),
        (rerank.Rerank, pb.RerankRequest(query="q", texts=["a"]), "Rerank"),
        (rerank.RerankStream, iter([pb.RerankStreamRequest(query="q", text="a")]), "RerankStream"),
    ]
    for call, message, method in calls:
        error = refused(call, message)
        assert error.code() == grpc.StatusCode.UNIMPLEMENTED, (method, error)
        assert "this server serves embedding models" in (error.details() or "") and method in (error.details() or "")
        # every method it does serve named (TokenizeStream and DecodeStream were left out)
        assert "tei.v1's Embed, EmbedStream, Info, Tokenize, TokenizeStream, Decode and DecodeStream;" in (
            error.details() or ""
        )
    assert len(embed.Embed(pb.EmbedRequest(inputs="still here"), timeout=WAIT).embeddings) == 32


def test_reflection_describes_tei_v1_and_the_calls_are_counted(server: ServerThread, channel: grpc.Channel) -> None:
    """grpcurl finds tei.v1 by reflection (TEI's documentation calls it so), and the calls are in the metrics."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="tei.v1.Embed"),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=WAIT))
    names = {s.name for s in listed.list_services_response.service}
    assert {"tei.v1.Info", "tei.v1.Embed", "tei.v1.Predict", "tei.v1.Rerank", "tei.v1.Tokenize"} <= names
    files = [FileDescriptorProto.FromString(b) for b in described.file_descriptor_response.file_descriptor_proto]
    tei = next(f for f in files if f.package == "tei.v1")
    embed = next(s for s in tei.service if s.name == "Embed")
    assert {"Embed", "EmbedStream"} <= {m.name for m in embed.method}

    port = server.server.metrics_port
    assert port is not None

    def embeds() -> float:
        return sum(
            s.value
            for s in scrape(port)
            if s.name == "mhaserve_requests_total"
            and s.labels.get("method") == "tei.v1.Embed/Embed"
            and s.labels.get("code") == "OK"
        )

    before = embeds()
    pb_grpc.EmbedStub(channel).Embed(pb.EmbedRequest(inputs="counted"), timeout=WAIT)
    assert embeds() == before + 1


def test_normalize_unset_is_true_and_prompts_are_the_models(tmp_path: Path) -> None:
    """TEI reads an unset `normalize` as true, whatever the model's default (here false, from its serving
    config); `prompt_name` puts the config's prompt before the text, and Tokenize shows the prompt's tokens
    with no offsets in the text sent, as TEI's HTTP route here does."""
    opts = ExportOptions(source="random", repository=tmp_path, name="e5", version=1, random_config=dict(TINY), seed=5)
    export_entry(opts, out=io.StringIO())
    config = {"prompts": {"query": "query: "}, "normalize": False}
    (tmp_path / "e5" / "serving.json").write_text(json.dumps(config))
    with ServerThread(local_settings(tmp_path)) as srv, srv.ready().channel() as channel:
        stub = pb_grpc.EmbedStub(channel)
        unset = np.asarray(stub.Embed(pb.EmbedRequest(inputs="what is it"), timeout=WAIT).embeddings)
        assert abs(float(np.linalg.norm(unset)) - 1.0) < 1e-6
        raw = stub.Embed(pb.EmbedRequest(inputs="what is it", normalize=False), timeout=WAIT).embeddings
        np.testing.assert_allclose(raw, encode(channel, ["what is it"])[0], rtol=0, atol=1e-6)  # the model's default
        prompted = stub.Embed(pb.EmbedRequest(inputs="what is it", prompt_name="query"), timeout=WAIT)
        np.testing.assert_allclose(
            prompted.embeddings, encode(channel, ["query: what is it"], normalize=True)[0], rtol=0, atol=1e-6
        )
        tokens = pb_grpc.TokenizeStub(channel).Tokenize(
            pb.EncodeRequest(inputs="what is it", prompt_name="query", add_special_tokens=True), timeout=WAIT
        )
        body = {"inputs": "what is it", "prompt_name": "query"}
        (http,) = request("POST", srv.http_url + "/tokenize", body).json()
        assert [(t.id, t.start if t.HasField("start") else None) for t in tokens.tokens] == [
            (t["id"], t["start"]) for t in http
        ]
        assert [t.HasField("start") for t in tokens.tokens[:4]] == [False, False, False, False]  # [CLS], q u e
        assert prompted.metadata.compute_tokens == len(tokens.tokens)


UPSTREAM = Path(__file__).with_name("tei_upstream.proto")  # TEI's own proto/tei.proto, copied unchanged


def test_our_proto_has_teis_wire_format(tmp_path: Path) -> None:
    """TEI's gRPC clients make their stubs from TEI's proto/tei.proto: ours must be the same package, messages,
    fields, enums and methods (only the comments differ), so that their stubs and ours read each other."""
    out = tmp_path / "upstream.pb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{UPSTREAM.parent}",
            f"--descriptor_set_out={out}",
            UPSTREAM.name,
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    (upstream,) = FileDescriptorSet.FromString(out.read_bytes()).file
    pool = descriptor_pool.DescriptorPool()
    pool.Add(upstream)
    theirs, mine = describe_file(pool.FindFileByName(upstream.name)), describe_file(pb.DESCRIPTOR)
    assert "tei.v1.EmbedRequest" in theirs and "tei.v1.Embed" in theirs, "nothing to compare"
    assert mine == theirs


def test_a_stream_is_answered_by_one_version_of_its_model(tmp_path: Path, grpc_front: str) -> None:
    """TEI's answers name no version: an EmbedStream open while a version was published had its later texts
    answered by it, two embedding spaces in one stream with nothing to tell them apart. A stream is now answered
    by the version served at its first request; once that one is retired, its next request ends it UNAVAILABLE,
    saying so, and a new stream gets the new version. The stream does not hold the retired one: held, a stream
    its client kept open kept that version in memory (a review's finding)."""
    from tests.service.test_models import publish_copy

    opts = ExportOptions(source="random", repository=tmp_path, name="m", version=1, random_config=dict(TINY), seed=3)
    export_entry(opts, out=io.StringIO())
    settings = local_settings(tmp_path, grpc_front=grpc_front, model_control="poll", repository_poll_s=0.05)
    with ServerThread(settings) as srv, srv.ready().channel() as channel:
        stub = pb_grpc.EmbedStub(channel)
        old = srv.server.dataplane.resolve("m")
        sent: queue.Queue[pb.EmbedRequest | None] = queue.Queue()
        stream = stub.EmbedStream(iter(sent.get, None), timeout=WAIT)
        sent.put(pb.EmbedRequest(inputs="the same text"))
        first = next(stream).embeddings
        sent.put(pb.EmbedRequest(inputs="the same text"))
        np.testing.assert_array_equal(next(stream).embeddings, first)
        publish_copy(tmp_path, "m", 1, 2, seed=4)
        wait_until(lambda: _serves(channel, 2), "version 2 served")
        wait_until(lambda: old.closed, "version 1 closed, the stream open")
        new = stub.Embed(pb.EmbedRequest(inputs="the same text"), timeout=WAIT).embeddings
        assert not np.allclose(new, first, atol=1e-3)  # the versions tell apart
        sent.put(pb.EmbedRequest(inputs="the same text"))
        with pytest.raises(grpc.RpcError) as e:
            next(stream)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert e.value.details() == (
            "model 'm' version 1, which answers this stream, is no longer served (versions served: 2): a stream's "
            "answers come from one version; open a new stream"
        )
        sent.put(None)
        again = stub.EmbedStream(iter([pb.EmbedRequest(inputs="the same text")]), timeout=WAIT)
        np.testing.assert_array_equal(next(again).embeddings, new)


def _serves(channel: grpc.Channel, version: int) -> bool:
    try:
        encode(channel, ["x"], model_version=version)
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):  # retired; loading
            return False
        raise
    return True


def test_an_empty_input_refused_is_counted_as_a_failure_of_the_model(
    server: ServerThread, channel: grpc.Channel
) -> None:
    """As POST /embed's is (a review's finding: the same refusal over tei.v1 was counted nowhere)."""

    def fails() -> int:
        stats = request("GET", server.http_url + "/v2/models/tiny/stats").json()["model_stats"][0]
        return int(stats["inference_stats"]["fail"]["count"])

    before = fails()
    stub = pb_grpc.EmbedStub(channel)
    assert refused(stub.Embed, pb.EmbedRequest(inputs="")).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused(stub.EmbedStream, iter([pb.EmbedRequest(inputs="")])).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fails() == before + 2
