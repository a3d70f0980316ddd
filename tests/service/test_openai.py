"""The official `openai` Python client against a real mhaserve: embeddings equal Encode's, and each error
arrives as the client's own exception class, after which the server answers as usual."""

from __future__ import annotations

import dataclasses
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import openai
import pytest

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service.settings import Settings
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.http import request
from mhaserve.testing.loopback import WAIT, free_port, wait_until
from mhaserve.testing.server import ServerThread, local_settings

TEXTS = ["hello world", "a", "héllo wörld 🤖", "the quick brown fox jumps over the lazy dog " * 3]
Start = Callable[..., ServerThread]


def client(server: ServerThread, **kw: Any) -> openai.OpenAI:
    # No retries: the tests look at each answer; a real client would retry 429 and 5xx itself.
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def vectors(response: Any) -> npt.NDArray[np.float32]:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)], dtype=np.float32)


def encode(server: ServerThread, **request: Any) -> npt.NDArray[np.float32]:
    with server.channel() as channel:
        reply = pb_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(**request), timeout=WAIT)
    return np.array([e.values for e in reply.embeddings], dtype=np.float32)


@pytest.fixture(scope="module")
def http_server(tiny_repo: Any) -> Iterator[ServerThread]:
    with ServerThread(local_settings(tiny_repo)).ready() as srv:
        yield srv


def test_float_and_base64_give_the_same_vectors_as_encode(http_server: ServerThread) -> None:
    c = client(http_server)
    as_float = c.embeddings.create(input=TEXTS, model="tiny", encoding_format="float")
    as_base64 = c.embeddings.create(input=TEXTS, model="tiny")  # the client asks for base64 by default
    expected = encode(http_server, texts=TEXTS, normalize=True)
    np.testing.assert_allclose(vectors(as_float), expected, atol=1e-6)
    np.testing.assert_array_equal(vectors(as_base64), expected)  # base64 carries the float32 bits themselves
    np.testing.assert_allclose(np.linalg.norm(vectors(as_float), axis=1), 1.0, atol=1e-6)
    assert as_float.model == "tiny" and as_float.object == "list"
    assert [d.index for d in as_float.data] == list(range(len(TEXTS)))
    assert all(d.object == "embedding" for d in as_float.data)


def test_a_base_url_without_v1_is_served_too(http_server: ServerThread) -> None:
    """A client given the server's bare URL, as one set up for Infinity (which serves OpenAI's API without the
    prefix) is, asks for `/embeddings` and `/models`."""
    bare = openai.OpenAI(base_url=http_server.http_url, api_key="unused", max_retries=0)
    assert [m.id for m in bare.models.list().data] == ["tiny", "tiny:1"]
    assert bare.models.retrieve("tiny:1").id == "tiny:1"
    response = bare.embeddings.create(input=TEXTS, model="tiny")
    np.testing.assert_array_equal(vectors(response), encode(http_server, texts=TEXTS, normalize=True))
    with pytest.raises(openai.BadRequestError) as e:
        bare.embeddings.create(input="", model="tiny")
    assert "input 0 is an empty string" in e.value.message


def test_usage_counts_the_real_tokens(http_server: ServerThread) -> None:
    response = client(http_server).embeddings.create(input=TEXTS, model="tiny")
    tokens = request("POST", http_server.http_url + "/tokenize", {"inputs": TEXTS}).json()
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(len(t) for t in tokens)


def test_one_string_and_token_ids(http_server: ServerThread) -> None:
    c = client(http_server)
    one = c.embeddings.create(input="hello world", model="tiny")
    np.testing.assert_allclose(vectors(one), encode(http_server, texts=["hello world"]), atol=1e-6)
    ids = [[2, 40, 41, 42, 3], [2, 7, 3]]
    many = c.embeddings.create(input=ids, model="tiny", encoding_format="float")
    by_ids = encode(http_server, token_ids=[pb.TokenIds(ids=r) for r in ids], normalize=True)
    np.testing.assert_allclose(vectors(many), by_ids, atol=1e-6)
    single = c.embeddings.create(input=ids[0], model="tiny", encoding_format="float")
    np.testing.assert_allclose(vectors(single), by_ids[:1], atol=1e-6)
    assert many.usage.prompt_tokens == 8


def test_dimensions_truncate_and_renormalise(http_server: ServerThread) -> None:
    c = client(http_server)
    full = vectors(c.embeddings.create(input=TEXTS, model="tiny", encoding_format="float"))
    for d in (1, 8, 31, 32):
        cut = vectors(c.embeddings.create(input=TEXTS, model="tiny", dimensions=d, encoding_format="float"))
        assert cut.shape == (len(TEXTS), d)
        np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-6)
        expected = full[:, :d] / np.linalg.norm(full[:, :d], axis=1, keepdims=True)
        np.testing.assert_allclose(cut, expected, atol=1e-6)


def test_normalize_false_gives_the_pooled_vector(http_server: ServerThread) -> None:
    """The bug: the route ignored `normalize` as an unknown field, so a client that asked for the raw vector (as
    TEI's API and encoder.v1 take it) got a normalised one, unwarned."""
    c = client(http_server)
    raw = vectors(c.embeddings.create(input=TEXTS, model="tiny", extra_body={"normalize": False}))
    np.testing.assert_array_equal(raw, encode(http_server, texts=TEXTS, normalize=False))
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)
    unit = vectors(c.embeddings.create(input=TEXTS, model="tiny", extra_body={"normalize": True}))
    np.testing.assert_allclose(unit, raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-6)
    # with dimensions, the leading values as they are, as TEI answers them (a 400 until 2026-12-07)
    cut = vectors(c.embeddings.create(input=TEXTS, model="tiny", dimensions=8, extra_body={"normalize": False}))
    np.testing.assert_array_equal(cut, raw[:, :8])
    with pytest.raises(openai.BadRequestError):
        c.embeddings.create(input=TEXTS, model="tiny", extra_body={"normalize": "no"})


def test_the_default_model_and_the_model_list(http_server: ServerThread) -> None:
    c = client(http_server)
    without = request("POST", http_server.http_url + "/v1/embeddings", {"input": "hello"}).json()
    assert without["model"] == "tiny"
    listed = c.models.list().data
    assert [m.id for m in listed] == ["tiny", "tiny:1"]  # the latest version by name, and each version
    assert all((m.object, m.owned_by) == ("model", "mhaserve") and m.created > 1_700_000_000 for m in listed)
    assert c.models.retrieve("tiny").id == "tiny"
    assert c.models.retrieve("tiny:1").id == "tiny:1"
    assert c.models.retrieve("tiny:01").id == "tiny:1"  # as listed
    # a response names the model as the request did, by name or at a version (as /v1/models lists them)
    assert c.embeddings.create(input="a", model="tiny").model == "tiny"
    assert c.embeddings.create(input="a", model="tiny:1").model == "tiny:1"
    assert c.embeddings.create(input="a", model="tiny:01").model == "tiny:1"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")
    # a version past int()'s 4,300 digits: a ValueError, answered 500 (and retried twice by the client)
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("tiny:" + "9" * 4301)
    with pytest.raises(openai.NotFoundError):
        c.embeddings.create(input="a", model="tiny:" + "9" * 4301)
    assert c.embeddings.create(input="a", model="tiny:" + "0" * 5000 + "1").model == "tiny:1"  # as tiny:01 is
    # a colon with nothing on one side of it names no model version: said, not read as the latest
    for model in ("tiny:", ":1"):
        with pytest.raises(openai.BadRequestError) as e:
            c.models.retrieve(model)
        assert "name a model, or name:version" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            c.embeddings.create(input="a", model=model)
        assert e.value.param == "model"


@pytest.mark.parametrize(
    ("kwargs", "message", "param"),
    [
        ({"input": []}, "input is empty", "input"),
        ({"input": ""}, "input 0 is an empty string", "input"),
        ({"input": ["a"] * 9}, "9 inputs in one request; the limit is 8", "input"),
        ({"input": [[2, 300, 3]]}, "token id 300, outside the vocabulary [0, 256)", "input"),
        ({"input": [[2, 2**63, 3]]}, "outside the vocabulary [0, 256)", "input"),
        ({"input": "word " * 400, "extra_body": {"truncate": False}}, "more than the model's maximum of 160", "input"),
        ({"input": "a", "dimensions": 33}, "dimensions is 33; this model's embeddings have 32", "dimensions"),
        ({"input": "a", "dimensions": 0}, "dimensions is 0", "dimensions"),
        ({"input": "a", "encoding_format": "float16"}, "encoding_format", "encoding_format"),
        # one readable sentence, not pydantic's first union member ("input.str: ... (and 7 more)")
        ({"input": [1, "a"]}, "input: must be a text, a list of texts, a list of token ids", "input"),
        ({"input": [101, 1.0, 102]}, "input: must be a text, a list of texts, a list of token ids", "input"),
        # as an empty string is named (it read "must be a text, a list of texts...": a user-test's finding)
        ({"input": [[2, 3], []]}, "input 1 is an empty list of token ids", "input"),
    ],
    ids=[
        "empty",
        "empty-string",
        "too-many",
        "vocabulary",
        "past-int64",
        "too-long",
        "dimensions-high",
        "dimensions-0",
        "format",
        "mixed",
        "a-float-id",
        "empty-ids",
    ],
)
def test_bad_requests_are_bad_request_errors(
    http_server: ServerThread, kwargs: dict[str, Any], message: str, param: str
) -> None:
    c = client(http_server)
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="tiny", **kwargs)
    assert e.value.status_code == 400 and message in e.value.message
    assert e.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert e.value.param == param  # the field at fault, as OpenAI names it
    assert e.value.response.headers["x-request-id"]
    # the server goes on
    assert len(c.embeddings.create(input="still here", model="tiny").data) == 1


def test_too_many_inputs_are_refused_before_each_is_validated(
    http_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validating 300,000 token-id lists (3 MB, 8 KB gzipped) held the event loop half a second before the
    count was refused: the count comes first, and the refusal is in the model's statistics as any other."""
    from mhaserve.service import openai as openai_module

    validated: list[Any] = []
    real = openai_module.validate

    def validate(model: Any, data: Any) -> Any:
        validated.append(data)
        return real(model, data)

    monkeypatch.setattr(openai_module, "validate", validate)

    def fails() -> int:
        stats = request("GET", http_server.http_url + "/v2/models/tiny/stats").json()["model_stats"][0]
        return int(stats["inference_stats"]["fail"]["count"])

    before = fails()
    for input_ in ([[2, 5, 3]] * 9, ["a"] * 9, [[2, 5, 3]] * 8 + ["a"]):
        reply = request("POST", http_server.http_url + "/v1/embeddings", {"input": input_, "model": "tiny"})
        assert reply.status == 400 and "9 inputs in one request; the limit is 8" in reply.json()["error"]["message"]
    assert validated == [] and fails() == before + 3
    # A model not served, or a name that is not a string, is said before the inputs are validated too: the
    # count was skipped for them, and 500,000 token-id lists naming "nope" held the loop 1.4-2.7 s for a 404.
    reply = request("POST", http_server.http_url + "/v1/embeddings", {"input": [[2, 5, 3]] * 9, "model": "nope"})
    assert reply.status == 404 and reply.json()["error"]["param"] == "model", reply.body
    for model in (5, None):
        reply = request("POST", http_server.http_url + "/v1/embeddings", {"input": [[2, 5, 3]] * 9, "model": model})
        assert reply.status == 400, reply.body
        assert reply.json()["error"] == {
            "message": "model: Input should be a valid string",
            "type": "invalid_request_error",
            "param": "model",
            "code": "invalid_argument",
        }
    assert validated == []
    # said as the validated request says it, where the count does not come first
    reply = request("POST", http_server.http_url + "/v1/embeddings", {"input": "a", "model": 5})
    assert reply.status == 400 and reply.json()["error"]["message"] == "model: Input should be a valid string"
    assert len(validated) == 1
    assert len(encode_http(http_server, ["a"] * 8)) == 8  # within the limit: validated and served
    assert len(validated) == 2


def encode_http(server: ServerThread, texts: list[str]) -> list[Any]:
    reply = request("POST", server.http_url + "/v1/embeddings", {"input": texts, "model": "tiny"})
    assert reply.status == 200, reply.body[:300]
    return list(reply.json()["data"])


def test_truncate_is_an_extension_field(http_server: ServerThread) -> None:
    c = client(http_server)
    long = "word " * 400
    response = c.embeddings.create(input=long, model="tiny", extra_body={"truncate": True})
    assert response.usage.prompt_tokens == 160


def test_a_long_text_is_cut_by_default_unless_the_request_says_truncate_false(http_server: ServerThread) -> None:
    """--auto-truncate is on by default, as text-embeddings-inference's, whose OpenAI route embeds a long text
    as sentence-transformers does (cut at the model's maximum): a client that sends no truncate gets what
    truncate true gives; an explicit false wins over the server's setting, and is refused as before."""
    c = client(http_server)
    long = "word " * 400
    cut = c.embeddings.create(input=[long, "a"], model="tiny")
    asked = c.embeddings.create(input=[long, "a"], model="tiny", extra_body={"truncate": True})
    assert cut.usage.prompt_tokens == asked.usage.prompt_tokens == 160 + 3
    np.testing.assert_array_equal(vectors(cut), vectors(asked))
    np.testing.assert_allclose(vectors(cut), encode(http_server, texts=[long, "a"], truncate=True), atol=1e-6)
    null = request("POST", http_server.http_url + "/v1/embeddings", {"input": long, "model": "tiny", "truncate": None})
    assert null.status == 200 and null.json()["usage"]["prompt_tokens"] == 160
    for asked_input in (long, [7] * 161):
        with pytest.raises(openai.BadRequestError) as e:
            c.embeddings.create(input=asked_input, model="tiny", extra_body={"truncate": False})
        assert "tokens long, more than the model's maximum of 160" in e.value.message


def test_null_for_an_optional_field_is_its_default(http_server: ServerThread) -> None:
    """`dimensions`, `truncate` and `prompt_name` took null as unset, but `encoding_format` and `normalize`
    refused it (400): a client that writes every field, unset ones as null (the openai client itself does, given
    encoding_format=None), was refused for a field it did not mean to set."""
    url = http_server.http_url + "/v1/embeddings"
    plain = request("POST", url, {"input": "a", "model": "tiny"}).json()["data"][0]["embedding"]
    nulls = {"encoding_format": None, "normalize": None, "dimensions": None, "truncate": None, "prompt_name": None}
    reply = request("POST", url, {"input": "a", "model": "tiny"} | nulls)
    assert reply.status == 200, reply.body
    assert reply.json()["data"][0]["embedding"] == plain  # floats, normalised
    c = client(http_server)
    assert c.embeddings.create(input="a", model="tiny", encoding_format=None).data[0].embedding == plain  # type: ignore[arg-type]


def test_no_auto_truncate_refuses_a_long_text(start: Start, settings: Settings) -> None:
    srv = start(dataclasses.replace(settings, http_port=free_port(), auto_truncate=False))
    with pytest.raises(openai.BadRequestError) as e:
        client(srv).embeddings.create(input="word " * 400, model="tiny")
    assert "input 0 is 1602 tokens long, more than the model's maximum of 160" in e.value.message
    response = client(srv).embeddings.create(input="word " * 400, model="tiny", extra_body={"truncate": True})
    assert response.usage.prompt_tokens == 160


def test_an_unknown_model_is_not_found(http_server: ServerThread) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client(http_server).embeddings.create(input="a", model="text-embedding-3-small")
    assert "model 'text-embedding-3-small' is not served here (this server serves 'tiny')" in e.value.message
    # OpenAI's own code and param for an unknown model, which clients and proxies match on.
    assert e.value.code == "model_not_found"
    assert e.value.param == "model"


def test_openais_2048_inputs_in_one_request_are_served_by_default(tiny_repo: Any) -> None:
    """OpenAI takes 2,048 inputs in one request, and clients send batches of their own default size up to it
    (LlamaIndex 100, LangChain.js 512, chromadb a collection's every document): past the old default of 64 on a
    CPU each was refused 400. The batcher splits such a request across batches; one more input is refused."""
    with ServerThread(local_settings(tiny_repo, max_client_batch_size=None)).ready() as srv:
        texts = [f"document {i} " + "word " * (i % 20) for i in range(2048)]
        c = client(srv)
        response = c.embeddings.create(input=texts, model="tiny", encoding_format="float")
        got = vectors(response)
        assert got.shape == (2048, 32)
        np.testing.assert_allclose(got[::32], encode(srv, texts=texts[::32], normalize=True), atol=1e-5)
        with pytest.raises(openai.BadRequestError) as e:
            c.embeddings.create(input=[*texts, "one more"], model="tiny")
        assert "2049 inputs in one request; the limit is 2048 (split the request)" in e.value.message
        assert e.value.param == "input"


def test_a_full_queue_is_a_rate_limit_error_with_retry_after(start: Start, settings: Settings) -> None:
    engine = ScriptedEngine(hang_on=99)
    srv = start(
        dataclasses.replace(
            settings, http_port=free_port(), max_queue_size=4, max_client_batch_size=4, max_wait_ms=0.0
        ),
        engine.factory(),
    )
    try:
        c = client(srv)
        held = threading.Thread(target=lambda: c.embeddings.create(input=[[99]], model="tiny"), daemon=True)
        held.start()
        assert engine.hanging.wait(WAIT)
        queued = threading.Thread(target=lambda: c.embeddings.create(input=[[5]] * 4, model="tiny"), daemon=True)
        queued.start()
        wait_until(lambda: srv.depth() == 4, "four inputs queued behind the held batch")
        with pytest.raises(openai.RateLimitError) as e:
            c.embeddings.create(input=[[6]], model="tiny")
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        assert "the queue is full" in e.value.message
    finally:
        engine.release.set()
    held.join(WAIT)
    queued.join(WAIT)
    assert len(client(srv).embeddings.create(input=[[6]], model="tiny").data) == 1


def test_loading_is_503_and_an_engine_failure_500_with_the_request_id(start: Start, settings: Settings) -> None:
    loaded = threading.Event()
    engine = ScriptedEngine(fail_on=66)

    def slow_factory(entry: Any) -> ScriptedEngine:
        assert loaded.wait(WAIT)
        return engine

    srv = start(dataclasses.replace(settings, http_port=free_port()), slow_factory, ready=False)
    try:
        c = client(srv)
        with pytest.raises(openai.InternalServerError) as e:
            c.embeddings.create(input="a", model="tiny")
        assert e.value.status_code == 503 and "still loading" in e.value.message
        assert e.value.response.headers["retry-after"] == "1"
    finally:
        loaded.set()
    srv.ready()
    with pytest.raises(openai.InternalServerError) as e:
        client(srv).embeddings.create(input=[[66]], model="tiny", extra_headers={"x-request-id": "req-500"})
    assert e.value.status_code == 500
    assert "request id req-500" in e.value.message and "Traceback" not in e.value.message
    assert len(client(srv).embeddings.create(input=[[7]], model="tiny").data) == 1


def test_an_input_the_engine_fails_on_is_named_in_the_500(start: Start, settings: Settings) -> None:
    """Its neighbours in the batch are run again without it; the request, whole or nothing, fails naming it."""
    engine = ScriptedEngine(fail_on=66)
    srv = start(dataclasses.replace(settings, http_port=free_port()), engine.factory())
    with pytest.raises(openai.InternalServerError) as e:
        client(srv).embeddings.create(input=[[5], [66], [7]], model="tiny")
    assert e.value.status_code == 500
    assert "inference on input 1 of this request failed (RuntimeError)" in e.value.message
    assert "injected" not in e.value.message
    assert [[66]] in engine.batches  # run alone at last


def test_an_inference_timeout_is_504(start: Start, settings: Settings) -> None:
    engine = ScriptedEngine(hang_on=99, hang_for=WAIT)
    srv = start(
        dataclasses.replace(settings, http_port=free_port(), inference_timeout=0.3, max_wait_ms=0.0), engine.factory()
    )
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client(srv).embeddings.create(input=[[99]], model="tiny")
        assert e.value.status_code == 504 and "--inference-timeout" in e.value.message
    finally:
        engine.release.set()
    wait_until(lambda: srv.server.state == "serving", "the server to recover")
    assert len(client(srv).embeddings.create(input=[[7]], model="tiny").data) == 1


def test_a_client_that_leaves_is_cancelled_and_frees_its_place(start: Start, settings: Settings) -> None:
    """A client that closes its connection while its request waits: the request is cancelled (counted
    CANCELLED), its queue slot is free at once, it never reaches the model, and the server goes on."""
    engine = ScriptedEngine(gates=[98])  # a batch that starts with token 98 computes until the gate opens
    srv = start(dataclasses.replace(settings, http_port=free_port(), max_wait_ms=0.0), engine.factory())
    blocker = threading.Thread(target=lambda: client(srv).embeddings.create(input=[[98]], model="tiny"))
    blocker.start()
    wait_until(lambda: srv.gauge("mhaserve_requests_in_flight") == 1 and srv.depth() == 0, "the blocker to compute")
    before = srv.samples()
    body = b'{"input": [[41]], "model": "tiny"}'
    head = f"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
    with socket.create_connection(("127.0.0.1", srv.server.http_port or 0), timeout=WAIT) as conn:
        conn.sendall(head.encode() + b"\r\n\r\n" + body)
        wait_until(lambda: srv.depth() == 1, "the request to be queued")
    wait_until(lambda: srv.depth() == 0, "the queue slot to be freed")
    method = "POST /v1/embeddings"
    cancelled = srv.samples().get("mhaserve_requests_total", method=method, code="CANCELLED")
    assert cancelled - before.get("mhaserve_requests_total", method=method, code="CANCELLED") == 1
    engine.gates[98].set()
    blocker.join(WAIT)
    assert len(client(srv).embeddings.create(input=[[7]], model="tiny").data) == 1
    assert not engine.seen(41)
    # The gauge falls once the answer is written, a moment after the client has it.
    wait_until(lambda: srv.gauge("mhaserve_requests_in_flight") == 0, "nothing left in flight")
