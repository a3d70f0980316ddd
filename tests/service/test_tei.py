"""text-embeddings-inference's embedding API (`POST /embed`, `POST /similarity`, `POST /` and `/invocations`)
against a real mhaserve, through the client TEI's users have, huggingface_hub's `InferenceClient`, and plain
HTTP: the vectors are Encode's and the similarities their cosines, the options do what TEI's do, and errors
come in TEI's shape, after which the server answers as usual."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import HfHubHTTPError

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.runtime.errors import Internal, InvalidArgument
from mhaserve.service.settings import Settings
from mhaserve.service.tei import on_line
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.http import request
from mhaserve.testing.loopback import WAIT, free_port, wait_until
from mhaserve.testing.server import ServerThread, bare_settings, local_settings

TEXTS = ["hello world", "a", "héllo wörld 🤖", "the quick brown fox jumps over the lazy dog " * 3]
Start = Callable[..., ServerThread]


def encode(server: ServerThread, **fields: Any) -> npt.NDArray[np.float32]:
    with server.channel() as channel:
        reply = pb_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(**fields), timeout=WAIT)
    return np.array([e.values for e in reply.embeddings], dtype=np.float32)


def embed(server: ServerThread, body: Any, path: str = "/embed", **kw: Any) -> Any:
    return request("POST", server.http_url + path, body, **kw)


@pytest.fixture(scope="module")
def srv(tiny_repo: Any) -> Iterator[ServerThread]:
    with ServerThread(local_settings(tiny_repo)).ready() as server:
        yield server


def test_huggingface_hubs_client_gets_encodes_vectors(srv: ServerThread) -> None:
    """Given the server's URL, InferenceClient posts to `/` (TEI serves an embedding model there too); given
    `/embed`, there. Either way, the vectors encoder.v1 gives, normalised by default as TEI's are."""
    expected = encode(srv, texts=TEXTS, normalize=True)
    for url in (srv.http_url, srv.http_url + "/embed", srv.http_url + "/invocations"):
        client = InferenceClient(model=url, timeout=WAIT)
        np.testing.assert_allclose(client.feature_extraction(TEXTS[0]), expected[:1], atol=1e-6)
        np.testing.assert_allclose(client.feature_extraction(TEXTS), expected, atol=1e-6)
    client = InferenceClient(model=srv.http_url, timeout=WAIT)
    raw = client.feature_extraction(TEXTS, normalize=False)
    np.testing.assert_array_equal(raw, encode(srv, texts=TEXTS, normalize=False))
    cut = client.feature_extraction(TEXTS, dimensions=8)
    full = expected[:, :8]
    np.testing.assert_allclose(cut, full / np.linalg.norm(full, axis=1, keepdims=True), atol=1e-6)
    # With normalize false, the leading values as they are, as TEI answers (this was a 400 here), on every route
    # and over encoder.v1.
    leading = client.feature_extraction(TEXTS, normalize=False, dimensions=8)
    np.testing.assert_array_equal(leading, raw[:, :8])
    np.testing.assert_array_equal(encode(srv, texts=TEXTS, normalize=False, dimensions=8), raw[:, :8])
    body = {"input": TEXTS, "normalize": False, "dimensions": 8}
    data = request("POST", srv.http_url + "/v1/embeddings", body).json()["data"]
    np.testing.assert_array_equal(np.array([d["embedding"] for d in data], dtype=np.float32), raw[:, :8])
    long = "word " * 400
    truncated = client.feature_extraction(long, truncate=True, truncation_direction="right")
    np.testing.assert_allclose(truncated, encode(srv, texts=[long], normalize=True, truncate=True), atol=1e-6)


def test_huggingface_hubs_client_raises_with_the_servers_message(srv: ServerThread) -> None:
    client = InferenceClient(model=srv.http_url, timeout=WAIT)
    with pytest.raises(HfHubHTTPError) as e:
        client.feature_extraction("word " * 400, truncate=False)
    assert e.value.response is not None and e.value.response.status_code == 400
    assert "more than the model's maximum of 160" in str(e.value)
    assert client.feature_extraction("still here").shape == (1, 32)


def kept_end(srv: ServerThread, text: str) -> list[int]:
    """The ids of `text` cut at its start to the model's maximum, as TEI's truncation_direction left cuts it: its
    opening and closing special tokens, and between them the last of its own."""
    whole = [t["id"] for t in embed(srv, {"inputs": text}, "/tokenize").json()[0]]  # no truncate: every token
    return [whole[0], *whole[1:-1][-(160 - 2) :], whole[-1]]


def test_truncation_direction_left_keeps_a_long_inputs_end(srv: ServerThread) -> None:
    """TEI's `truncation_direction` left (this was a 400 here): a long input's start is cut, its end kept, through
    huggingface_hub's client, on every TEI route, for texts and for token ids; an input within the maximum is not
    cut at all."""
    client = InferenceClient(model=srv.http_url, timeout=WAIT)
    text = "alpha beta gamma " * 60 + "the end of a long text, which is what the left truncation keeps"
    end = encode(srv, token_ids=[pb.TokenIds(ids=kept_end(srv, text))], normalize=True)
    start = encode(srv, texts=[text], normalize=True, truncate=True)
    assert not np.allclose(end, start, atol=1e-3)  # the two ends of this text embed apart
    left = client.feature_extraction(text, truncate=True, truncation_direction="left")
    np.testing.assert_allclose(left, end, atol=1e-6)
    for path, direction in (("/embed", "Left"), ("/", "left"), ("/invocations", "left")):  # Left: TEI's own spelling
        body = {"inputs": [text, "short"], "truncate": True, "truncation_direction": direction}
        got = np.array(embed(srv, body, path).json(), dtype=np.float32)
        np.testing.assert_allclose(got[:1], end, atol=1e-6)
        np.testing.assert_allclose(got[1:], encode(srv, texts=["short"], normalize=True), atol=1e-6)
    # token ids: the same ids cut the same way, the special tokens kept at both ends
    whole = [t["id"] for t in embed(srv, {"inputs": text}, "/tokenize").json()[0]]
    ids = embed(srv, {"inputs": [whole], "truncate": True, "truncation_direction": "left"}).json()
    np.testing.assert_allclose(np.array(ids, dtype=np.float32), end, atol=1e-6)
    # /similarity cuts its sentences so too
    parameters = {"truncation_direction": "left", "truncate": True}
    body = {"inputs": {"source_sentence": text, "sentences": [text, "short"]}, "parameters": parameters}
    sims = embed(srv, body, "/similarity").json()
    unit = end[0] / np.linalg.norm(end[0])
    assert abs(sims[0] - 1.0) < 1e-5
    short = encode(srv, texts=["short"], normalize=True)[0]
    assert abs(sims[1] - float(unit @ short)) < 1e-5
    # refused as the right cut is, when not to cut
    refused = embed(srv, {"inputs": text, "truncate": False, "truncation_direction": "left"})
    assert refused.status == 400 and "more than the model's maximum of 160" in refused.json()["error"]


def cosines(server: ServerThread, source: str, sentences: list[str], **fields: Any) -> npt.NDArray[np.float64]:
    """The cosine of each sentence's Encode vector with the source's, in float64."""
    vectors = encode(server, texts=[source, *sentences], normalize=False, **fields).astype(np.float64)
    return (vectors[1:] @ vectors[0]) / (np.linalg.norm(vectors[1:], axis=1) * np.linalg.norm(vectors[0]))


def test_huggingface_hubs_client_gets_similarities(srv: ServerThread) -> None:
    """`sentence_similarity` posts `inputs` as an object to the URL it is given: the server's own (`/`, where
    TEI answers it only when started for that task), `/similarity` or `/invocations` each answer the cosines
    of Encode's vectors, in order, rounded to float32 from float64."""
    expected = cosines(srv, TEXTS[0], TEXTS[1:])
    for path in ("", "/similarity", "/invocations"):
        client = InferenceClient(model=srv.http_url + path, timeout=WAIT)
        got = client.sentence_similarity(TEXTS[0], TEXTS[1:])
        assert len(got) == len(TEXTS) - 1
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert InferenceClient(model=srv.http_url, timeout=WAIT).sentence_similarity("hello", ["hello"]) == [
        pytest.approx(1.0, abs=1e-6)
    ]
    long = "word " * 400
    body = {"inputs": {"source_sentence": long, "sentences": ["a", "word"]}, "parameters": {"truncate": True}}
    reply = embed(srv, {**body, "model": "tiny:1"}, path="/similarity")
    assert reply.status == 200 and reply.headers["content-type"] == "application/json"
    np.testing.assert_allclose(reply.json(), cosines(srv, long, ["a", "word"], truncate=True), rtol=1e-6, atol=1e-7)


SIMILARITY_ERRORS = [
    ({"inputs": {"source_sentence": "a", "sentences": []}}, 400, "inputs.sentences is empty"),
    ({"inputs": {"source_sentence": "", "sentences": ["a"]}}, 400, "inputs.source_sentence is an empty string"),
    ({"inputs": {"source_sentence": "a", "sentences": ["b", ""]}}, 400, "inputs.sentences 1 is an empty string"),
    # the source is one more input to embed, as TEI counts it
    ({"inputs": {"source_sentence": "a", "sentences": ["b"] * 8}}, 400, "9 inputs in one request; the limit is 8"),
    ({"inputs": {"source_sentence": "a"}}, 400, "inputs.sentences: Field required"),
    ({"inputs": {"source_sentence": "a", "sentences": "b"}}, 400, "inputs.sentences"),
    ({"inputs": {"source_sentence": "a", "sentences": [1]}}, 400, "inputs.sentences"),
    # a text too long is named by its field, as the empty ones are (by the list the pipeline embeds once:
    # "input 2 is ... set truncate")
    (
        {"inputs": {"source_sentence": "word " * 400, "sentences": ["a"]}, "parameters": {"truncate": False}},
        400,
        "inputs.source_sentence is 1602 tokens long, more than the model's maximum of 160",
    ),
    (
        {"inputs": {"source_sentence": "a", "sentences": ["b", "word " * 400]}, "parameters": {"truncate": False}},
        400,
        "inputs.sentences 1 is 1602 tokens long, more than the model's maximum of 160 (special tokens included); "
        "shorten it or set parameters.truncate",
    ),
    ({"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"prompt_name": "q"}}, 400, "prompt 'q'"),
    ({"inputs": {"source_sentence": "a", "sentences": ["b"]}, "model": "nope"}, 404, "model 'nope' is not served"),
]


@pytest.mark.parametrize(("body", "status", "message"), SIMILARITY_ERRORS)
def test_bad_similarity_requests_are_answered_in_teis_shape(
    srv: ServerThread, body: Any, status: int, message: str
) -> None:
    for path in ("/similarity", "/", "/invocations"):
        reply = embed(srv, body, path=path)
        assert reply.status == status, (path, reply.body[:300])
        error = reply.json()
        assert set(error) == {"error", "error_type"} and message in error["error"], error
        assert error["error_type"] == "Validation"
    reply = embed(srv, {"inputs": "a"}, path="/similarity")  # an embedding request is not one
    assert reply.status == 400 and "inputs" in reply.json()["error"]
    assert embed(srv, {"inputs": {"source_sentence": "a", "sentences": ["b"]}}, path="/similarity").status == 200


def test_token_ids_and_the_model_extension(srv: ServerThread) -> None:
    ids = [[2, 40, 41, 42, 3], [2, 7, 3]]
    by_ids = encode(srv, token_ids=[pb.TokenIds(ids=r) for r in ids], normalize=True)
    np.testing.assert_allclose(embed(srv, {"inputs": ids}).json(), by_ids, atol=1e-6)
    np.testing.assert_allclose(embed(srv, {"inputs": ids[0]}, path="/").json(), by_ids[:1], atol=1e-6)
    named = embed(srv, {"inputs": "hello world", "model": "tiny:1", "truncation_direction": "Right"})
    np.testing.assert_allclose(named.json(), encode(srv, texts=["hello world"], normalize=True), atol=1e-6)
    assert named.headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"inputs": []}, 400, "inputs is empty"),
        ({"inputs": ""}, 400, "input 0 is an empty string"),
        ({"inputs": ["a", ""]}, 400, "input 1 is an empty string"),
        ({"inputs": ["a"] * 9}, 400, "9 inputs in one request; the limit is 8"),
        ({"inputs": [[2, 300, 3]]}, 400, "token id 300, outside the vocabulary [0, 256)"),
        ({"inputs": ["a", [2, 3]]}, 400, "inputs: must be a text, a list of texts, a list of token ids"),
        ({"inputs": [[2, 3], []]}, 400, "input 1 is an empty list of token ids"),
        ({"inputs": "word " * 400, "truncate": False}, 400, "more than the model's maximum of 160"),
        ({"inputs": "a", "truncation_direction": "middle"}, 400, "truncation_direction"),
        ({"inputs": "a", "dimensions": 33}, 400, "dimensions is 33; this model's embeddings have 32"),
        ({"inputs": "a", "prompt_name": "query"}, 400, "has no prompt 'query'"),
        ({"inputs": "a", "normalize": "yes"}, 400, "normalize"),
        ({"input": "a"}, 400, "inputs"),  # OpenAI's field name on TEI's route
        ({"inputs": "a", "model": "nope"}, 404, "model 'nope' is not served here"),
    ],
)
def test_bad_requests_are_answered_in_teis_shape(srv: ServerThread, body: Any, status: int, message: str) -> None:
    for path in ("/embed", "/"):
        reply = embed(srv, body, path=path)
        assert reply.status == status, (path, reply.body[:300])
        error = reply.json()
        assert set(error) == {"error", "error_type"} and message in error["error"], error
        assert error["error_type"] == "Validation"
        assert reply.headers["x-request-id"]
    assert len(embed(srv, {"inputs": "still here"}).json()) == 1


def test_truncate_null_is_the_servers_choice(start: Start, settings: Settings) -> None:
    """TEI reads a missing or null truncate as the server's --auto-truncate (on by default, as TEI's since
    v1.9.2), and an explicit one as it says: a long text is embedded as truncate true embeds it (as
    sentence-transformers cuts it), unless the request or --no-auto-truncate says otherwise."""
    long = "word " * 400
    similarity = {"inputs": {"source_sentence": long, "sentences": ["a", "word"]}}
    auto = start(dataclasses.replace(settings, http_port=free_port()))
    client = InferenceClient(model=auto.http_url, timeout=WAIT)
    expected = encode(auto, texts=[long], normalize=True, truncate=True)
    np.testing.assert_allclose(client.feature_extraction(long), expected, atol=1e-6)
    cosine = embed(auto, {**similarity, "parameters": {"truncate": True}}, path="/similarity").json()
    for path in ("/embed", "/", "/invocations"):
        for body in ({"inputs": long}, {"inputs": long, "truncate": None}):
            reply = embed(auto, body, path=path)
            assert reply.status == 200, (path, reply.body[:300])
            np.testing.assert_allclose(reply.json(), expected, atol=1e-6)
        reply = embed(auto, {"inputs": long, "truncate": False}, path=path)
        assert reply.status == 400 and "1602 tokens long" in reply.json()["error"], path
    assert embed(auto, similarity, path="/similarity").json() == cosine
    no_cut = embed(auto, {**similarity, "parameters": {"truncate": False}}, path="/similarity")
    assert no_cut.status == 400 and "inputs.source_sentence is 1602 tokens long" in no_cut.json()["error"]
    with pytest.raises(HfHubHTTPError) as e:
        client.feature_extraction(long, truncate=False)
    assert e.value.response is not None and e.value.response.status_code == 400

    strict = start(dataclasses.replace(settings, http_port=free_port(), auto_truncate=False))
    for body in ({"inputs": long}, {"inputs": long, "truncate": None}):
        assert embed(strict, body).status == 400
    np.testing.assert_allclose(embed(strict, {"inputs": long, "truncate": True}).json(), expected, atol=1e-6)
    assert embed(strict, similarity, path="/similarity").status == 400


def test_refusals_before_the_route_are_in_teis_shape_too(start: Start, settings: Settings, tmp_path: Any) -> None:
    keys = tmp_path / "keys"
    keys.write_text("secret\n")
    srv = start(dataclasses.replace(settings, http_port=free_port(), api_keys_file=keys))
    for path in ("/embed", "/similarity", "/invocations"):
        reply = embed(srv, {"inputs": "a"}, path=path)
        error = reply.json()
        assert reply.status == 401 and error["error_type"] == "Validation" and "API key" in error["error"], path
    reply = embed(srv, b'{"inputs": "a"', headers={"authorization": "Bearer secret"})
    assert reply.status == 400 and reply.json()["error"].startswith("the body is not valid JSON")
    client = InferenceClient(model=srv.http_url, token="secret", timeout=WAIT)
    assert client.feature_extraction("a").shape == (1, 32)
    assert len(client.sentence_similarity("a", ["b"])) == 1


def test_answers_carry_teis_timing_headers(start: Start, settings: Settings) -> None:
    """As TEI's: the inputs' characters (a token list's ids) and tokens, the request's time in the server in
    milliseconds (x-total-time, and x-compute-time the same), and where it went, within it; a model that
    computes 30 ms a batch shows 30 ms or more of inference."""
    engine = ScriptedEngine(seconds_per_batch=0.03)
    srv = start(dataclasses.replace(settings, http_port=free_port()), engine.factory())
    texts = ["héllo wörld 🤖", "a"]
    tokens = sum(len(t) for t in request("POST", srv.http_url + "/tokenize", {"inputs": texts}).json())
    similarity = {"inputs": {"source_sentence": texts[0], "sentences": texts[1:]}}
    asked = [
        ("/embed", {"inputs": texts}, len("héllo wörld 🤖a"), tokens),
        ("/", {"inputs": texts[0]}, len(texts[0]), tokens - 3),  # "a" is [CLS] a [SEP]
        ("/invocations", {"inputs": [[5, 6, 7], [8]]}, 4, 4),
        ("/similarity", similarity, len("héllo wörld 🤖a"), tokens),
    ]
    for path, body, chars, count in asked:
        reply = embed(srv, body, path=path)
        assert reply.status == 200, reply.json()
        h = {k: int(v) for k, v in reply.headers.items() if k.startswith("x-") and k != "x-request-id"}
        assert (h["x-compute-characters"], h["x-compute-tokens"]) == (chars, count), (path, h)
        assert h["x-inference-time"] >= 30 and h["x-compute-time"] == h["x-total-time"], (path, h)
        assert h["x-tokenization-time"] + h["x-queue-time"] + h["x-inference-time"] <= h["x-total-time"], (path, h)


def test_the_routes_are_counted_in_the_request_metrics(srv: ServerThread) -> None:
    counts = [
        ("OK", "POST /embed"),
        ("OK", "POST /"),
        ("INVALID_ARGUMENT", "POST /embed"),
        ("OK", "POST /similarity"),
        ("OK", "POST /invocations"),
    ]
    before = [srv.counted(*c) for c in counts]
    embed(srv, {"inputs": "a"})
    embed(srv, {"inputs": "a"}, path="/")
    embed(srv, {"inputs": ""})
    embed(srv, {"inputs": {"source_sentence": "a", "sentences": ["b"]}}, path="/similarity")
    embed(srv, {"inputs": "a"}, path="/invocations")
    # (a request is counted as its answer goes out, after the client may have read it)
    wait_until(lambda: [srv.counted(*c) - b for c, b in zip(counts, before, strict=True)] == [1] * 5, "counted")


def jsonl(server: ServerThread, lines: list[Any] | bytes, media: str = "application/jsonlines") -> Any:
    """POST /invocations with a JSON Lines body, as a SageMaker batch transform sends a MultiRecord mini-batch."""
    body = lines if isinstance(lines, bytes) else b"\n".join(json.dumps(line).encode() for line in lines)
    return request("POST", server.http_url + "/invocations", body, headers={"content-type": media})


def test_a_json_lines_body_on_invocations_is_answered_a_line_each(srv: ServerThread) -> None:
    """SageMaker's batch transform with BatchStrategy MultiRecord and SplitType Line sends many lines of its
    input file in one request: each line is answered as /invocations answers it alone, a line each, in order
    (embeddings and similarities alike), with no newline after the last (AssembleWith Line adds one)."""
    records = [
        {"inputs": "hello world"},
        {"inputs": ["a", "héllo wörld 🤖"], "normalize": False},
        {"inputs": {"source_sentence": "a query", "sentences": ["a passage", "another"]}},
        {"inputs": "word " * 400, "truncate": True},
        *({"inputs": f"text number {i}"} for i in range(60)),  # more lines than are computed at once
    ]
    for media in ("application/jsonlines", "application/x-ndjson; charset=utf-8"):
        reply = jsonl(srv, records, media)
        assert reply.status == 200, reply.body[:300]
        assert reply.headers["content-type"] == "application/jsonlines"
        assert reply.headers.get("transfer-encoding") == "chunked" and not reply.body.endswith(b"\n")
        lines = reply.body.split(b"\n")
        assert len(lines) == len(records)
        for record, line in zip(records, lines, strict=True):
            alone = embed(srv, record, path="/invocations").json()
            np.testing.assert_allclose(json.loads(line), alone, rtol=0, atol=1e-6)
    # a file's last newline, and Windows' line ends, change nothing
    body = b"\r\n".join(json.dumps(r).encode() for r in records[:3]) + b"\r\n"
    reply = jsonl(srv, body)
    assert reply.status == 200 and len(reply.body.split(b"\n")) == 3
    # nor do blank lines after the last (a file that ends in two newlines) or a byte order mark before the first
    # (a file saved by Windows' Notepad): each failed the whole mini-batch 400
    for padded in (body + b"\n\r\n \n", b"\xef\xbb\xbf" + body):
        again = jsonl(srv, padded)
        assert again.status == 200 and again.body == reply.body, again.body[:300]


def test_a_json_lines_body_never_fills_the_queue_by_itself(tiny_repo: Any) -> None:
    """Each line is a request the server takes, so the body is served on an idle server however many lines it
    has: it once computed 32 lines at once, whatever their inputs, and overflowed a queue of 256 with five lines
    of 64 inputs (429 for the whole body, every time it was retried). Its lines in the queue at once now hold at
    most half the queue's room (one line at least), the rest left to other clients."""
    settings = dataclasses.replace(local_settings(tiny_repo), max_queue_size=4, max_client_batch_size=4)
    with ServerThread(settings).ready() as server:
        records = [{"inputs": [f"text {i}", "and", "more"]} for i in range(6)]  # 18 inputs, 3 a line
        reply = jsonl(server, records)
        assert reply.status == 200, reply.body[:300]
        for record, line in zip(records, reply.body.split(b"\n"), strict=True):
            np.testing.assert_allclose(json.loads(line), embed(server, record).json(), rtol=0, atol=1e-6)


def publish_copy(model: Path, source: int, version: int) -> None:
    """Publish `version` of a model as a copy of `source`, by one rename (a scripted engine answers alike)."""
    scratch = model / f".copy-{version}"
    shutil.copytree(model / str(source), scratch)
    manifest = json.loads((scratch / "manifest.json").read_text())
    (scratch / "manifest.json").write_text(json.dumps(manifest | {"version": version}))
    scratch.rename(model / str(version))


class _Versioned:
    """The scripted engine of a version, whose last value of each row says which version computed it."""

    providers = ScriptedEngine.providers

    def __init__(self, engine: ScriptedEngine, version: int) -> None:
        self.engine, self.version = engine, version

    def run(self, ids: Any, mask: Any, *, beside: bool = False) -> npt.NDArray[np.float32]:
        rows = self.engine.run(ids, mask, beside=beside).copy()
        rows[:, 3] = self.version
        return rows


def test_a_json_lines_body_is_answered_by_one_model_version(start: Start, tiny_repo: Path, tmp_path: Path) -> None:
    """A body's lines are answered by the version of their model served when the body came, however long it
    takes: its lines were each sent to the model's latest when computed, and a version published while line 1
    was held answered the last 8 of 40 lines, two embedding spaces in one answer with nothing to tell them
    apart. The version retired meanwhile serves the body's last lines, and closes once they are answered."""
    shutil.copytree(tiny_repo / "tiny", tmp_path / "tiny")
    engine = ScriptedEngine(gates=[77])
    settings = bare_settings(tmp_path, "tiny", http_port=free_port(), model_control="explicit")
    srv = start(settings, lambda entry: _Versioned(engine, entry.version))
    # line 1 is held in the model; the others name the model, or not, and are computed meanwhile up to the window
    records = [{"inputs": [[77 if i == 0 else 5, 6]], "normalize": False} for i in range(40)]
    for record in records[1::2]:
        record["model"] = "tiny"

    def index() -> list[tuple[str, str]]:
        return [(m["version"], m["state"]) for m in request("POST", srv.http_url + "/v2/repository/index", {}).json()]

    reply: dict[str, Any] = {}
    body = threading.Thread(target=lambda: reply.update(answer=jsonl(srv, records)))
    body.start()
    try:
        wait_until(lambda: engine.seen(77), "line 1 in the model")
        publish_copy(tmp_path / "tiny", 1, 2)
        assert request("POST", srv.http_url + "/v2/repository/models/tiny/load").status == 200
        assert index() == [("1", "UNLOADING"), ("2", "READY")]  # version 1 retired, finishing what it holds
    finally:
        engine.gates[77].set()
        body.join(WAIT)
    answer = reply["answer"]
    assert answer.status == 200, answer.body[:300]
    rows = [json.loads(line)[0] for line in answer.body.split(b"\n")]
    assert [row[3] for row in rows] == [1.0] * 40
    assert rows[0][:3] == [2.0, 77.0, 83.0] and rows[-1][:3] == [2.0, 5.0, 11.0]
    # the body held version 1 no longer than it took: it closes, and a new body is version 2's
    wait_until(lambda: index() == [("2", "READY")], "version 1 closed")
    assert [json.loads(line)[0][3] for line in jsonl(srv, records[1:3]).body.split(b"\n")] == [2.0, 2.0]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b'{"inputs": "a"}\n{"inputs": "b"\n{"inputs": "c"}', 400, "line 2: it is not valid JSON"),
        # orjson said "str is not valid UTF-8: surrogates not allowed ... (char 0)"
        (
            b'{"inputs": "a"}\n{"inputs": "caf\xe9"}',
            400,
            "line 2: it is not valid JSON: the body is not valid UTF-8 (JSON is): at byte 15, invalid",
        ),
        (b'{"inputs": "a"}\n\n{"inputs": "c"}', 400, "line 2: it is empty"),
        (b'{"inputs": "a"}\n{"inputs": ""}', 400, "line 2: input 0 is an empty string"),
        (b'{"inputs": "a"}\n{"inputs": "a", "model": "nope"}', 404, "line 2: model 'nope' is not served here"),
        # found only once computed: nothing is answered but the error
        (
            b'{"inputs": "a"}\n{"inputs": "a"}\n{"inputs": "' + b"word " * 400 + b'", "truncate": false}',
            400,
            "line 3: input 0 is",
        ),
        (b"", 400, "the JSON Lines body has no lines"),
        (b'{"inputs": "a"}\n' * 65537, 413, "65537 lines in one JSON Lines body; the most in one is 65536"),
    ],
)
def test_a_bad_json_lines_body_is_refused_naming_its_line(
    srv: ServerThread, body: bytes, status: int, message: str
) -> None:
    reply = jsonl(srv, body)
    assert reply.status == status, reply.body[:300]
    error = reply.json()
    assert set(error) == {"error", "error_type"} and message in error["error"], error
    assert jsonl(srv, [{"inputs": "still here"}]).status == 200
    # JSON Lines are read on /invocations only: the other routes take one JSON body
    refused = embed(srv, b'{"inputs": "a"}', headers={"content-type": "application/jsonlines"})
    assert refused.status == 415 and "JSON Lines" not in refused.json()["error"]
    # and /invocations' refusal of another type names both it takes (it named JSON alone)
    refused = jsonl(srv, b'{"inputs": "a"}', media="text/csv")
    assert refused.status == 415 and refused.json()["error"] == (
        "send the body as JSON with 'Content-Type: application/json', or as JSON Lines ('Content-Type: "
        "application/jsonlines', a request a line), not 'text/csv'"
    )


def test_a_lines_error_names_its_line_and_leaves_the_error_others_share_alone() -> None:
    """A batch's failure is one error object, raised to every request with an input in the batch: naming the
    line in it would tell another client of a line it never sent."""
    shared = Internal("a batch failed in the engine (request id abc)")
    named = on_line(shared, 3)
    assert type(named) is Internal and named.message == "line 3: a batch failed in the engine (request id abc)"
    assert shared.message == str(shared) == "a batch failed in the engine (request id abc)"
    assert on_line(InvalidArgument("input 0 is an empty string", param="inputs"), 2).param == "inputs"


@pytest.mark.parametrize("path", ["/rerank", "/predict", "/embed_sparse", "/embed_all"])
def test_teis_routes_for_other_kinds_of_model_say_what_is_served(srv: ServerThread, path: str) -> None:
    """A client of a TEI serving a reranker, a classifier or a sparse model, pointed here, is told so in TEI's
    error shape, where it read "no route"."""
    reply = embed(srv, {"query": "q", "texts": ["a"], "inputs": "a"}, path=path)
    assert reply.status == 404
    error = reply.json()
    assert set(error) == {"error", "error_type"}, error
    assert "serves embedding models" in error["error"]
    if path == "/rerank":  # it read "text-embeddings-inference's route a reranker's; ..." (a user-test's finding)
        assert error["error"] == (
            "no route POST /rerank: text-embeddings-inference serves it for a reranker; this server serves "
            "embedding models (POST /embed, /similarity, /v1/embeddings)"
        )
    assert embed(srv, {"inputs": "a"}, path="/nope").json()["error"]["message"] == "no route POST /nope"
