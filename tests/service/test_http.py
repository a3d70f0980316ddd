"""The HTTP API on raw sockets: what a misbehaving client sends, and what every client gets back.

Malformed and mistyped bodies, huge bodies, unknown routes, clients that trickle their headers or their
body, arbitrary JSON (hypothesis): never a 5xx, never a hung connection, and the server answers the
next request as usual. Request ids, metrics and the OpenAPI document, too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import hypothesis.strategies as st
import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service import tokens as tokens_module
from mhaserve.service.connections import ConnectionLimit
from mhaserve.service.context import Throttle
from mhaserve.service.http.bodies import PAUSE_COLLECTOR_BYTES, parse_json
from mhaserve.service.http.middleware import CallMiddleware
from mhaserve.service.http.server import REQUEST_WARNINGS, HttpServer
from mhaserve.service.settings import Settings
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.http import request
from mhaserve.testing.loopback import WAIT, free_port, wait_until
from mhaserve.testing.metrics import scrape
from mhaserve.testing.server import ServerThread, local_settings

READ_TIMEOUT = 1.0  # --http-header-timeout of the server under test


@pytest.fixture(scope="module")
def srv(tiny_repo: Path) -> Iterator[ServerThread]:
    settings = local_settings(tiny_repo, max_message_bytes=1 << 20, http_header_timeout=READ_TIMEOUT)
    with ServerThread(settings).ready() as server:
        yield server


def url(srv: ServerThread, path: str) -> str:
    return srv.http_url + path


def still_serving(srv: ServerThread) -> None:
    reply = request("POST", url(srv, "/v1/embeddings"), {"input": "still here", "model": "tiny"})
    assert reply.status == 200, reply.body
    assert len(reply.json()["data"]) == 1


def openai_error(reply_body: bytes) -> dict[str, object]:
    error = json.loads(reply_body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b'{"input": "a"', 400, "the body is not valid JSON"),
        (b"[1, 2]", 400, "body"),
        (b'{"input": 5}', 400, "input"),
        (b'{"input": "a", "dimensions": "many"}', 400, "dimensions"),
        # as the KServe routes' truncate: "yes" or 1 is not read as true
        (b'{"input": "a", "truncate": "yes"}', 400, "truncate"),
        (b'{"input": "a", "truncate": 1}', 400, "truncate"),
        (b'{"input": "a", "model": 3}', 400, "model"),
        (b"\xff\xfe", 400, "not valid JSON"),
        # orjson's words for it were "str is not valid UTF-8: surrogates not allowed", of a body without one
        (b'{"input": "caf\xe9"}', 400, "the body is not valid UTF-8 (JSON is): at byte 14, invalid continuation byte"),
        (b'{"input": "caf\x80"}', 400, "the body is not valid UTF-8 (JSON is): at byte 14, invalid start byte"),
    ],
)
def test_malformed_bodies_are_400_in_openais_shape(srv: ServerThread, body: bytes, status: int, message: str) -> None:
    reply = request("POST", url(srv, "/v1/embeddings"), body, {"content-type": "application/json"})
    assert reply.status == status
    error = openai_error(reply.body)
    assert message in str(error["message"]) and error["type"] == "invalid_request_error"
    still_serving(srv)


def test_kserve_routes_answer_errors_in_their_own_shape(srv: ServerThread) -> None:
    reply = request("POST", url(srv, "/v2/models/tiny/infer"), b"{not json")
    assert reply.status == 400 and "not valid JSON" in reply.json()["error"]
    reply = request("POST", url(srv, "/v2/models/nope/infer"), {"inputs": []})
    assert reply.status == 404 and reply.json() == {
        "error": "model 'nope' is not served here (this server serves 'tiny')"
    }
    # Strict as Triton: a shape of strings, a bare value for data (the protocol's data is an array)
    text = {"name": "text", "datatype": "BYTES"}
    for tensor, message in (
        ({**text, "shape": ["1"], "data": ["a"]}, "shape"),
        ({**text, "shape": [1.0], "data": ["a"]}, "shape"),
        ({**text, "shape": [1], "data": "a"}, "must be a JSON array"),
        ({**text, "shape": [1]}, "has no data"),
    ):
        reply = request("POST", url(srv, "/v2/models/tiny/infer"), {"inputs": [tensor]})
        assert reply.status == 400 and message in reply.json()["error"], (tensor, reply.body)
    reply = request("POST", url(srv, "/v2/models/tiny/infer"), {"inputs": [{**text, "shape": [1], "data": ["a"]}]})
    assert reply.status == 200
    # nested as deep as orjson reads (1,024): past Python's recursion limit, it was a 500
    deep = b"[" * 1001 + b'"a"' + b"]" * 1001
    body = b'{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ' + deep + b"}]}"
    reply = request("POST", url(srv, "/v2/models/tiny/infer"), body, {"content-type": "application/json"})
    assert reply.status == 200, reply.body[:200]
    nested = {**text, "shape": [2, 1], "data": [[["a"]], ["b", ["c"]]]}
    reply = request("POST", url(srv, "/v2/models/tiny/infer"), {"inputs": [nested]})
    assert reply.status == 400 and "3 elements" in reply.json()["error"], reply.body


def test_a_body_in_another_format_is_415(srv: ServerThread) -> None:
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        reply = request("POST", url(srv, "/v1/embeddings"), b'{"input": "a"}', {"content-type": content_type})
        assert reply.status == 415, content_type
        assert "Content-Type: application/json" in str(openai_error(reply.body)["message"])
    assert request("POST", url(srv, "/v1/embeddings"), b'{"input":"a"}', {"content-encoding": "br"}).status == 415


def test_a_byte_order_mark_before_a_json_body_is_ignored(srv: ServerThread) -> None:
    """A file saved by a Windows editor begins with UTF-8's byte order mark, and `curl -d @file` sends it: RFC 8259
    lets a parser ignore it, and every route that reads JSON does (it was a 400, "not valid JSON")."""
    bom = b"\xef\xbb\xbf"
    headers = {"content-type": "application/json"}
    routes = (
        ("/v1/embeddings", b'{"input": "a windows file", "model": "tiny"}', lambda r: r["data"][0]["embedding"]),
        ("/embed", b'{"inputs": "a windows file"}', lambda r: r[0]),
        ("/tokenize", b'{"inputs": "a windows file"}', lambda r: r[0]),
        (
            "/v2/models/tiny/infer",
            b'{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a windows file"]}]}',
            lambda r: r["outputs"][0]["data"],
        ),
    )
    for path, body, answer in routes:
        plain, marked = (request("POST", url(srv, path), b, headers) for b in (body, bom + body))
        assert plain.status == marked.status == 200, (path, marked.body[:200])
        assert answer(marked.json()) == answer(plain.json()), path
    # one mark, as a file begins with: a second is the body's first character, and no JSON
    assert request("POST", url(srv, "/v1/embeddings"), bom + bom + b'{"input": "a"}', headers).status == 400


def test_compressed_bodies_are_read_whole_or_refused(srv: ServerThread) -> None:
    """gzip and deflate bodies (tritonclient sends them): a gzip stream of several members is read whole (as
    gzip.decompress reads it); one cut short, or with bytes after its end, is a 400, not served as far as
    it inflated."""
    import gzip

    body = b'{"input": ["one", "two"]}'
    whole = gzip.compress(body)
    members = gzip.compress(body[:10]) + gzip.compress(body[10:])
    deflated = zlib.compress(body)
    headers = {"content-type": "application/json"}

    def post(data: bytes, encoding: str) -> Any:
        return request("POST", url(srv, "/v1/embeddings"), data, headers | {"content-encoding": encoding})

    read = ((whole, "gzip"), (members, "gzip"), (whole + b"\x00" * 8, "gzip"), (deflated, "deflate"), (whole, "X-Gzip"))
    for data, encoding in read:  # x-gzip is gzip (RFC 9110, 8.4.1.3)
        reply = post(data, encoding)
        assert reply.status == 200 and len(reply.json()["data"]) == 2, (encoding, reply.body[:200])
    for data, encoding, message in (
        (whole[:-9], "gzip", "cut short"),
        (whole + b"garbage", "gzip", "does not inflate"),
        (deflated + b"garbage", "deflate", "7 bytes after the end"),
    ):
        reply = post(data, encoding)
        assert reply.status == 400 and message in str(openai_error(reply.body)["message"]), (message, reply.body)
    # past the limit once inflated (the limit is 1 MiB here): 413, saying so
    reply = post(gzip.compress(b'{"input": "' + b"x" * (2 << 20) + b'"}'), "gzip")
    assert reply.status == 413 and str(openai_error(reply.body)["message"]) == (
        "the request body is at least 1048577 bytes once inflated; the limit is 1048576 (--max-message-bytes): "
        "split the request"
    )
    still_serving(srv)


def test_a_body_over_the_limit_is_413_without_being_read(srv: ServerThread) -> None:
    big = b'{"input": "' + b"x" * (20 << 20) + b'"}'
    reply = request("POST", url(srv, "/v1/embeddings"), big, {"content-type": "application/json"})
    assert reply.status == 413
    assert "the limit is 1048576" in str(openai_error(reply.body)["message"])
    still_serving(srv)


@pytest.mark.parametrize(
    ("length", "said"),
    [("10000000000000000000", "at least 9223372036854775808"), ("0" * 5000 + "99999999999", "99999999999")],
)
def test_a_declared_length_past_the_limit_is_413_at_once_however_it_is_written(
    srv: ServerThread, length: str, said: str
) -> None:
    """A Content-Length of 20 digits (past an int64) was read as none declared once lengths were capped there,
    and the server waited for the body; one padded with 4,300 zeros was a ValueError in int(), a 500."""
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
        s.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())
        answer = s.recv(4096)
        while b"split the request" not in answer and (more := s.recv(4096)):  # the body may come on its own
            answer += more
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert f"the request body is {said} bytes".encode() in answer  # not a length it was not told
    still_serving(srv)


def test_a_chunked_body_over_the_limit_is_413(srv: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        s.sendall(b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        for _ in range(40):  # 2.5 MiB, more than the 1 MiB limit: read and dropped, then refused
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        s.sendall(b"0\r\n\r\n")
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:100]
    still_serving(srv)


def test_unknown_routes_and_methods(srv: ServerThread) -> None:
    reply = request("GET", url(srv, "/v1/nothing"))
    assert reply.status == 404 and "no route GET /v1/nothing" in str(openai_error(reply.body)["message"])
    before = srv.samples().get("mhaserve_requests_total", code="UNIMPLEMENTED")
    reply = request("DELETE", url(srv, "/v1/embeddings"))
    assert reply.status == 405 and openai_error(reply.body)["code"] == "unimplemented"
    assert reply.headers["allow"] == "POST" and reply.headers["x-request-id"]
    # every method the path takes, where two routes share it (GET / is health, POST / embeds)
    assert request("DELETE", url(srv, "/")).headers["allow"] == "GET, HEAD, POST"
    assert request("PUT", url(srv, "/health")).headers["allow"] == "GET, HEAD"
    wait_until(lambda: srv.samples().get("mhaserve_requests_total", code="UNIMPLEMENTED") == before + 3, "counted")
    still_serving(srv)


def test_head_is_gets_answer_without_its_body(srv: ServerThread) -> None:
    """Uptime monitors and some balancers' checks send HEAD (RFC 9110: general-purpose servers support it)."""
    for path in (
        "/health",
        "/ping",
        "/",
        "/v1/models",
        "/v2/health/ready",
        "/info",
        "/openapi.json",
        "/docs",
        "/redoc",
    ):
        got, head = request("GET", url(srv, path)), request("HEAD", url(srv, path))
        assert (head.status, head.body) == (got.status, b""), path
        assert head.headers["content-length"] == got.headers["content-length"] and head.headers["x-request-id"]
    reply = request("HEAD", url(srv, "/v1/embeddings"))  # no GET there: the method the client sent is refused
    assert reply.status == 405 and reply.headers["allow"] == "POST"
    still_serving(srv)


def test_a_trailing_slash_is_not_found_with_a_hint_not_redirected(srv: ServerThread) -> None:
    """A redirect named the scheme and host it was reached by (wrong behind a proxy that ends TLS)."""
    before = srv.samples().get("mhaserve_requests_total", method="POST (no route)", code="OK")
    reply = request("POST", url(srv, "/v1/embeddings/"), {"input": "a"}, {"host": "example.com:443"})
    assert reply.status == 404 and "location" not in reply.headers
    assert "(without the trailing slash: /v1/embeddings)" in str(openai_error(reply.body)["message"])
    assert request("GET", url(srv, "/v1/models/")).status == 404
    # a TEI route's, in TEI's error shape, as the route answers its own errors (it was OpenAI's)
    reply = request("POST", url(srv, "/embed/"), {"inputs": "a"})
    assert reply.status == 404 and reply.json() == {
        "error": "no route POST /embed/ (without the trailing slash: /embed)", "error_type": "Validation"
    }  # fmt: skip
    # a path of slashes alone has no path without them: the hint named an empty one
    assert str(openai_error(request("POST", url(srv, "//"), {"input": "a"}).body)["message"]) == "no route POST //"
    assert srv.samples().get("mhaserve_requests_total", method="POST (no route)", code="OK") == before


def test_metrics_asked_of_the_api_port_are_pointed_at_their_own(srv: ServerThread) -> None:
    """TEI serves Prometheus' `/metrics` on its API port: a scrape set up for it read a bare "no route"."""
    for path in ("/metrics", "/metrics/"):
        reply = request("GET", url(srv, path))
        assert reply.status == 404
        assert str(openai_error(reply.body)["message"]) == (
            f"no route GET {path}: the metrics are served on their own port (--metrics-port), not the API's"
        )
    still_serving(srv)


def test_a_slowloris_client_is_disconnected(srv: ServerThread) -> None:
    """Headers trickled a byte at a time never finish: the server closes the connection after the read timeout."""
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < 10 * READ_TIMEOUT:
            try:
                s.sendall(b"X")
                s.settimeout(0.2)
                if s.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
    assert closed, "the server kept a connection whose headers never ended"
    still_serving(srv)


@pytest.mark.parametrize("shape", ["many headers", "one long header", "a long url", "in one read"])
def test_headers_over_64_kib_are_431_before_any_key_is_read(
    srv: ServerThread, shape: str, caplog: pytest.LogCaptureFixture
) -> None:
    """httptools takes headers of any size: 64 MB of them, before the key check, cost a gigabyte. The 431 carries
    a request id, as every answer does, and its log line the same."""
    caplog.set_level(logging.INFO, logger="mhaserve.service.http.server")
    if shape == "many headers":
        head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n" + b"X-h: v\r\n" * 20_000
    elif shape == "one long header":
        head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nX-h: " + b"v" * 100_000 + b"\r\n"
    elif shape == "a long url":
        head = b"GET /v1/" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n"
    else:  # 70 KB, complete: it may arrive in one read, which no count of incomplete headers sees
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-h: " + b"v" * 70_000 + b"\r\n"
    more = b"" if shape == "in one read" else b"X-more: " + b"w" * 200_000 + b"\r\n"
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
        s.sendall(head + more + b"\r\n")
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(4096):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
    (rid,) = re.findall(rb"\r\nx-request-id: ([0-9a-f]{16})\r\n", answer.partition(b"\r\n\r\n")[0] + b"\r\n")
    assert any(rid.decode() in r.getMessage() and "431" in r.getMessage() for r in caplog.records), caplog.text
    # headers within the limit are served as before
    reply = request("POST", url(srv, "/v1/embeddings"), {"input": "a"}, {"x-h": "v" * 30_000})
    assert reply.status == 200
    # and a body of any size in the read that ends the headers is a body, not headers
    body = {"input": ["a " * 5_000] * 8, "truncate": True}
    assert len(json.dumps(body)) > 64 * 1024
    assert request("POST", url(srv, "/v1/embeddings"), body).status == 200
    still_serving(srv)


@pytest.mark.parametrize("shape", ["alone", "behind a request", "a field ended", "a name"])
def test_headers_over_64_kib_in_two_reads_are_431_whatever_came_before_them(srv: ServerThread, shape: str) -> None:
    """A request's headers cut across two reads of 60 KB each, the first read holding the request's start (alone,
    or behind a whole request in the same read): the first read's incomplete field, or its last field, ended but
    not yet handed on by the parser, was counted nowhere (the review: 120 KB, and 310 KB behind a request, of
    headers accepted)."""
    tiny = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    before = b"" if shape == "alone" else tiny
    start = b"GET /health HTTP/1.1\r\nHost: x\r\n" + (
        b"n" * 60_000 if shape == "a name" else b"X-big: " + b"v" * 60_000
    )
    rest = b"w" * 60_000 + (b": v" if shape == "a name" else b"") + b"\r\n\r\n"
    if shape == "a field ended":
        start, rest = start + b"\r\n", b"X-more: " + rest
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
        s.sendall(before + start)
        time.sleep(0.5)
        with contextlib.suppress(OSError):
            s.sendall(rest)
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                answer += chunk
    statuses = re.findall(rb"HTTP/1.1 (\d{3}) ", answer)
    assert statuses == ([b"200"] if before else []) + [b"431"], statuses
    still_serving(srv)


def _one_large_read(srv: ServerThread, engine: ScriptedEngine, payload: bytes) -> list[bytes]:
    """The statuses answered on one connection to `srv` (its engine gated on token 97) to: a request held in its
    batch, a small request pipelined behind it (uvicorn stops reading), then `payload`, held by the kernel and read
    at once when reading resumes (one read, up to the socket's buffer), all answers read to the connection's end."""
    body = b'{"input": [[97]], "model": "tiny"}'
    slow = (
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )
    try:
        with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
            s.sendall(slow)
            wait_until(lambda: any(97 in row for batch in engine.batches for row in batch), "the slow request's batch")
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.3)
            s.sendall(payload)
            time.sleep(0.3)
            engine.gates[97].set()
            answer = b""
            with contextlib.suppress(OSError):
                while chunk := s.recv(65536):
                    answer += chunk
    finally:
        engine.gates[97].set()
    return re.findall(rb"HTTP/1.1 (\d{3}) ", answer)


@pytest.mark.parametrize("padding", ["a value", "trailing spaces", "leading spaces", "trailing tabs", "an upgrade"])
def test_headers_over_64_kib_whole_in_one_read_behind_a_request_are_431(
    start: Callable[..., ServerThread], settings: Settings, padding: str
) -> None:
    """A request whose headers begin and end in one read behind another request in it was counted nowhere: the
    check before parsing found the first request's end, and after parsing no headers were incomplete (the
    review: 127 KiB of headers answered 200). One read that large comes when uvicorn has paused reading, a
    pipelined request waiting behind one in progress, and resumes. Counted field by field (the first fix), the
    spaces and tabs the parser strips from a value were not (the second review: 200 KB of tabs answered 200); and
    a refused request asking to upgrade to a WebSocket took uvicorn's upgrade path without a scope (a traceback,
    the connection aborted, every answer lost)."""
    engine = ScriptedEngine(gates=[97])
    srv = start(dataclasses.replace(settings, http_port=free_port()), lambda entry: engine)
    tiny = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    field = {
        "a value": b"X-h: " + b"v" * 90_000,
        "trailing spaces": b"X-h: v" + b" " * 90_000,
        "leading spaces": b"X-h:" + b" " * 90_000 + b"v",
        "trailing tabs": b"X-h: v" + b"\t" * 120_000,
        "an upgrade": b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        + b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nX-h: "
        + b"v" * 90_000,
    }[padding]
    big = b"GET /health HTTP/1.1\r\nHost: x\r\n" + field + b"\r\n\r\n"
    assert _one_large_read(srv, engine, tiny + big) == [b"200", b"200", b"200", b"431"]


@pytest.mark.parametrize("shift", [1, 2, 3, 4, 20, 500])  # the first 3: the piece ends inside the method
def test_a_request_pipelined_behind_a_large_body_in_one_read_is_served(
    start: Callable[..., ServerThread], settings: Settings, shift: int
) -> None:
    """A read larger than the header limit is parsed in pieces; a small request that began in a piece behind a
    body counted the body's bytes in that piece as its headers, and was refused 431 where it crossed into the next
    (the third review). Its own bytes are counted from its request line."""
    engine = ScriptedEngine(gates=[97])
    srv = start(dataclasses.replace(settings, http_port=free_port(), max_message_bytes=1 << 20), lambda entry: engine)

    def post(body: bytes) -> bytes:
        head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body

    head = post(b"")
    body = b'{"input": "a", "model": "tiny"}'
    # its end `shift` bytes before the first piece's (64 KiB), the next request across the two
    large = post(body + b" " * (65_536 - shift - len(head) + 1 - len(str(65_536)) - len(body)))
    assert len(large) == 65_536 - shift
    after = b"GET /health HTTP/1.1\r\nHost: x\r\nX-h: " + b"v" * 1_024 + b"\r\n\r\n"
    closing = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    assert _one_large_read(srv, engine, large + after + closing) == [b"200"] * 5


@pytest.mark.parametrize("spaces", [1, 2, 3])
def test_a_request_line_with_several_spaces_is_counted_from_its_start(srv: ServerThread, spaces: int) -> None:
    """llhttp takes several spaces between the method and the URL: a request's start looked for as its method, one
    space and its URL was found at a copy of that text later in its own headers, and its first read went nearly
    uncounted (the fourth review: 130 KB of headers answered 200)."""
    line = b"GET" + b" " * spaces + b"/health HTTP/1.1\r\n"
    first = line + b"Host: x\r\nX-a: " + b"a" * 63_000 + b"\r\nX-d: GET /health\r\n"  # a copy of it, one space
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
        s.sendall(first)
        time.sleep(0.5)
        with contextlib.suppress(OSError):
            s.sendall(b"X-c: " + b"c" * 62_000 + b"\r\n\r\n")
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                answer += chunk
    assert re.findall(rb"HTTP/1.1 (\d{3}) ", answer) == [b"431"]
    still_serving(srv)


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_headers_whose_end_is_cut_across_reads_are_not_refused(srv: ServerThread, cut: int) -> None:
    """A read that began with the last bytes of a request's headers ("\n", "\r\n", "\n\r\n") and held more than
    what was left of the limit (a large body) was refused 431: the check looked for the headers' end in that read
    alone (the fifth review)."""
    body = b'{"input": "a", "model": "tiny"}'
    body += b" " * (100_000 - len(body))
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    whole = head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
    end = len(whole) - len(body)
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
        s.sendall(whole[: end - cut])
        time.sleep(0.3)
        s.sendall(whole[end - cut :])
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                answer += chunk
    assert re.findall(rb"HTTP/1.1 (\d{3}) ", answer) == [b"200"]


def test_many_small_pipelined_requests_in_one_read_are_not_taken_for_headers(
    srv: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """A read of many pipelined requests that ended inside the last one's headers was counted whole as that
    request's headers: past 64 KiB of small requests, a 431 (and uvicorn's ERROR line "ASGI callable returned
    without completing response") where every request was far under the limit. Only the last request's own
    bytes count now; a request whose own headers pass the limit is still refused (the test above)."""
    caplog.set_level(logging.INFO)
    one = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    n = 3_000  # 108 KB, sent before the server reads, the last request cut in its headers
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
        s.sendall(one * n + one[:20])
        time.sleep(0.5)
        s.sendall(one[20:])
        data = b""
        while data.count(b"HTTP/1.1 ") < n + 1 and (chunk := s.recv(65536)):
            data += chunk
    statuses = re.findall(rb"HTTP/1.1 (\d{3}) ", data)
    assert len(statuses) == n + 1 and set(statuses) == {b"200"}, (len(statuses), set(statuses))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    still_serving(srv)


CHUNKED = (
    b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
)
LAST_CHUNK = b"e\r\n" + b'{"input": "a"}' + b"\r\n0\r\n"  # a body of one chunk, then the last one, size 0


@pytest.mark.parametrize("shape", ["many trailer fields", "one endless trailer field"])
def test_a_chunked_bodys_trailer_section_is_bounded_as_headers_are(srv: ServerThread, shape: str) -> None:
    """uvicorn adds a chunked body's trailer fields to the request's headers with no limit, and httptools holds a
    trailer field whole until it ends: 67 MB of them in 2 s took the server from 317 MB to 1.6 GB, kept after.
    The trailer section counts as headers do (64 KiB), its fields dropped: past that, 431, the connection closed."""
    piece = b"v" * 600 if shape == "one endless trailer field" else b"t: v\r\n" * 100
    sent = 0
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
        s.sendall(CHUNKED + LAST_CHUNK + (b"t: " if shape == "one endless trailer field" else b""))
        answer = b""
        with contextlib.suppress(OSError):
            while sent < 4_000_000:  # the server stops reading soon after its answer
                s.sendall(piece)
                sent += len(piece)
                s.settimeout(0)
                with contextlib.suppress(BlockingIOError):
                    if chunk := s.recv(4096):
                        answer += chunk
                        break
                s.settimeout(WAIT)
            s.settimeout(WAIT)
            while chunk := s.recv(4096):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 431"), (sent, answer[:200])
    assert b"trailer section are over 64 KiB in all" in answer
    # trailers within the limit are read and dropped, as a body in chunks of a byte is served
    chunks = b"".join(b"1\r\n%c\r\n" % c for c in b'{"input": "' + b"a " * 4_000 + b'"}')
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
        s.sendall(CHUNKED + chunks + b"0\r\nX-Checksum: 1\r\nX-More: 2\r\n\r\n")
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    still_serving(srv)


def test_a_read_that_ends_after_a_chunks_size_line_is_no_trailer(srv: ServerThread) -> None:
    """A read of a large chunk's data that ends just after the next chunk's size line was counted whole as
    trailer bytes, and a valid upload refused 431 now and then (about once in the chunk's size)."""
    body = json.dumps({"input": "a " * 45_000, "truncate": True}).encode()
    first, last = body[:-11], body[-11:]
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
        s.sendall(CHUNKED)
        time.sleep(0.1)
        s.sendall(b"%x\r\n" % len(first) + first + b"\r\n" + b"%x\r\n" % len(last))  # one read, if it can
        time.sleep(0.2)
        s.sendall(last + b"\r\n0\r\n\r\n")
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_a_trailer_section_refused_in_the_read_that_ends_it_is_answered_once(
    srv: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """Its 431 written, the same read went on to the request's end, which the app, waiting for its body, then
    answered on a connection already half-closed: an ERROR in the log for every such request; and not given that
    end, its body timer (1 s here) answered 408 there before the connection closed (2 s after the 431)."""
    caplog.set_level(logging.INFO)
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
        s.sendall(CHUNKED)
        time.sleep(0.2)  # the request's app waiting for its body
        s.sendall(LAST_CHUNK + b"X-T: " + b"v" * 70_000 + b"\r\n\r\n")
        time.sleep(2 * READ_TIMEOUT + 0.5)  # held open past the body's timer, as a client that reads late
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(4096):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 431") and answer.count(b"HTTP/1.1") == 1, answer[:300]
    time.sleep(0.5)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]
    still_serving(srv)


def test_malformed_requests_are_400_and_logged_once_a_minute(
    srv: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn warns once per malformed request: a TLS handshake or an HTTP/2 preface on the plain port, or a
    scanner, buried the log at a line a request."""
    caplog.set_level(logging.WARNING, logger="uvicorn.error")
    for garbage in (
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ) * 10:
        with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
            s.sendall(garbage)
            answer = b""
            with contextlib.suppress(OSError):
                while chunk := s.recv(4096):
                    answer += chunk
        assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
        assert re.search(rb"\r\nx-request-id: [0-9a-f]{16}\r\n", answer), answer  # as every answer has
    lines = [r for r in caplog.records if r.name == "uvicorn.error" and "Invalid HTTP request" in r.getMessage()]
    assert len(lines) <= 1, [r.getMessage() for r in lines]  # one, or none where an earlier test's line was the last
    still_serving(srv)


def test_the_throttle_says_how_many_lines_it_left_out() -> None:
    now = [0.0]
    throttle = Throttle(REQUEST_WARNINGS.messages, interval=60.0, clock=lambda: now[0])

    def line(msg: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, None, None)

    invalid = "Invalid HTTP request received."
    assert throttle.filter(line(invalid))
    assert not any(throttle.filter(line(invalid)) for _ in range(5))
    assert throttle.filter(line("Unsupported upgrade request."))  # each message has its own minute
    assert throttle.filter(line("something else"))  # other lines pass untouched
    now[0] = 61.0
    record = line(invalid)
    assert throttle.filter(record)
    assert record.getMessage() == "Invalid HTTP request received. (5 more since the last such line, not logged)"
    now[0] = 200.0
    record = line(invalid)
    assert throttle.filter(record) and record.getMessage() == invalid


def test_a_probe_is_not_in_flight(srv: ServerThread) -> None:
    """A probe held open (its body never sent) is not in the in-flight gauge, which the drain waits on too,
    while a model request held the same way is. The open probes cannot be held so: a body sent them is not read,
    and they answer at once, closing the connection (tests/security/test_auth.py: their bodies were counted
    against --max-incoming-bytes, which clients without a key could so fill)."""
    port = srv.server.metrics_port
    assert port
    for path in ("/health", "/", "/v2/health/ready"):
        with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=10 * READ_TIMEOUT) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n".encode())
            answer = b""
            while chunk := s.recv(4096):  # b"" once the server closes
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer, answer[:200]
    for path, counted in (("/v2/models/tiny/ready", 0), ("/info", 1)):
        with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=10 * READ_TIMEOUT) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n".encode())
            if counted:
                wait_until(lambda: scrape(port).get("mhaserve_requests_in_flight") == 1, "the request in flight")
            else:
                time.sleep(READ_TIMEOUT / 4)  # the request read and held: nothing to wait for but its arrival
                assert scrape(port).get("mhaserve_requests_in_flight") == 0, path
            assert s.recv(4096).startswith(b"HTTP/1.1 408")
    # counted out once its answer is written, which the client may read first
    wait_until(lambda: scrape(port).get("mhaserve_requests_in_flight") == 0, "nothing left in flight")


def test_a_silent_connection_is_closed_and_a_slow_body_is_408(srv: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=10 * READ_TIMEOUT) as s:
        assert s.recv(1) == b""  # nothing sent: closed after the read timeout, not held forever
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=10 * READ_TIMEOUT) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        s.sendall(b'Content-Length: 100\r\n\r\n{"input":')
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    still_serving(srv)


def test_clients_that_leave_while_the_model_loads_give_their_places_back(
    start: Callable[..., ServerThread], settings: Settings
) -> None:
    """--loading-wait: a request held for the model that loads, whose client leaves, is cancelled at once (counted
    CANCELLED, as other clients that leave) and gives its place back; they stayed in flight until the model came
    up, and once they held every place (--max-queue-size), a live request was refused at once."""
    loaded = threading.Event()
    hold = 2 * WAIT  # longer than any wait below: a request held ends because its client left, not its hold

    def slow_factory(entry: Path) -> ScriptedEngine:
        assert loaded.wait(hold)
        return ScriptedEngine()

    held = dataclasses.replace(
        settings, http_port=free_port(), loading_wait=hold, max_queue_size=2, max_client_batch_size=1
    )
    srv = start(held, slow_factory, ready=False)
    assert srv.server.http_port
    body = b'{"input": [[5]], "model": "tiny"}'
    head = f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    try:
        leaving = [socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) for _ in range(2)]
        for s in leaving:
            s.sendall(head.encode() + b"\r\n\r\n" + body)
        wait_until(lambda: srv.server.dataplane._held == 2, "both requests to hold every place")
        for s in leaving:
            s.close()
        wait_until(lambda: srv.gauge("mhaserve_requests_in_flight") == 0, "the requests whose clients left to end")
        assert srv.samples().get("mhaserve_requests_total", method="POST /v1/embeddings", code="CANCELLED") == 2
        with ThreadPoolExecutor(1) as pool:
            live = pool.submit(request, "POST", url(srv, "/v1/embeddings"), {"input": [[7]], "model": "tiny"})
            wait_until(lambda: srv.server.dataplane._held == 1, "the live request to be held")
            loaded.set()
            srv.ready()
            reply = live.result(timeout=WAIT)
    finally:
        loaded.set()
    assert reply.status == 200 and len(reply.json()["data"]) == 1
    wait_until(lambda: srv.gauge("mhaserve_requests_in_flight") == 0, "nothing left in flight")


def test_request_bytes_still_arriving_are_bounded_over_http_and_the_lean_grpc_front_together(
    tiny_repo: Path,
) -> None:
    """One limit for the process (--max-incoming-bytes, 1.5 MiB here): an HTTP body held 900 KB short of its end
    leaves too little for a gRPC message of 700 KB on the lean front (RESOURCE_EXHAUSTED) and for an HTTP body of
    700 KB (429, Retry-After), while small requests are served; once that client goes, both are read. Before
    service/incoming.py nothing bounded what such clients held together (docs/grpc-fronts.md)."""
    settings = local_settings(
        tiny_repo,
        grpc_front="lean",
        max_message_bytes=1 << 20,
        max_incoming_bytes=3 << 19,
        http_header_timeout=30.0,
    )
    text = "word " * 140_000  # 700 KB
    with ServerThread(settings).ready() as server:
        port = server.server.metrics_port
        assert port
        # The limit beside the count, for the dashboard's panel and an alert's ratio.
        assert scrape(port).get("mhaserve_incoming_request_bytes_limit") == 3 << 19
        encode = pb_grpc.EncoderServiceStub(server.channel()).Encode
        http = ("127.0.0.1", server.server.http_port)
        with socket.create_connection(http, timeout=30) as held:
            held.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
            held.sendall(b" " * 900_000)
            wait_until(lambda: scrape(port).get("mhaserve_incoming_request_bytes") == 900_000, "the body held")
            with pytest.raises(grpc.RpcError) as refused:
                encode(pb.EncodeRequest(texts=[text], truncate=True), timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-incoming-bytes" in str(refused.value.details())
            body = json.dumps({"input": text, "model": "tiny"})
            reply = request("POST", url(server, "/v1/embeddings"), body)
            assert reply.status == 429 and "retry-after" in reply.headers, (reply.status, reply.headers)
            assert "--max-incoming-bytes" in str(openai_error(reply.body)["message"])
            assert len(encode(pb.EncodeRequest(texts=["small"]), timeout=30).embeddings) == 1
            still_serving(server)
        wait_until(lambda: scrape(port).get("mhaserve_incoming_request_bytes") == 0, "the body let go")
        assert len(encode(pb.EncodeRequest(texts=[text], truncate=True), timeout=30).embeddings) == 1
        reply = request("POST", url(server, "/v1/embeddings"), body)
        assert reply.status != 429, reply.body[:200]  # read whole now, and answered for what it says


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "input": JSON,
        # (TEI's similarity inputs are an object of two fields, which arbitrary keys would seldom name)
        "inputs": JSON | st.fixed_dictionaries({}, optional={"source_sentence": JSON, "sentences": JSON}),
        "ids": JSON,
        "skip_special_tokens": JSON,
        "model": JSON,
        "encoding_format": JSON,
        "dimensions": JSON,
        "truncate": JSON,
        "normalize": JSON,
        "truncation_direction": JSON,
        "parameters": JSON,
        "outputs": JSON,
    },
)


@hsettings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=JSON | FIELDS,
    path=st.sampled_from(
        ["/v1/embeddings", "/embed", "/", "/similarity", "/tokenize", "/decode", "/v2/models/tiny/infer"]
    ),
)
def test_arbitrary_json_never_gets_a_5xx(srv: ServerThread, body: object, path: str) -> None:
    reply = request("POST", url(srv, path), json.dumps(body).encode(), {"content-type": "application/json"})
    assert reply.status < 500, (path, body, reply.status, reply.body[:300])


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tensor=st.fixed_dictionaries(
        {"name": st.sampled_from(["text", "input_ids", "attention_mask", "x"])},
        optional={"shape": JSON, "datatype": st.sampled_from(["BYTES", "INT64", "FP32", 3]), "data": JSON},
    ),
    binary=st.binary(max_size=64),
)
def test_arbitrary_kserve_tensors_never_get_a_5xx(srv: ServerThread, tensor: dict[str, object], binary: bytes) -> None:
    head = json.dumps({"inputs": [tensor | {"parameters": {"binary_data_size": len(binary)}}]}).encode()
    reply = request(
        "POST", url(srv, "/v2/models/tiny/infer"), head + binary, {"inference-header-content-length": str(len(head))}
    )
    assert reply.status < 500, (tensor, reply.body[:300])


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status"),
    [
        # ids past int64 (JSON numbers have no bound) are outside the vocabulary, as 2**63 - 1 is
        ("POST", "/v1/embeddings", {"input": [2**63]}, {}, 400),
        ("POST", "/v1/embeddings", {"input": [[2, 2**64 - 1, 3]]}, {}, 400),
        (
            "POST",
            "/v2/models/tiny/infer",
            {"inputs": [{"name": "input_ids", "shape": [1, 1], "datatype": "INT64", "data": [2**63]}]},
            {},
            400,
        ),
        # str.isdigit() is true of "²" and "١": a version is ASCII digits, anything else names none served
        ("POST", "/v1/embeddings", {"input": "a", "model": "tiny:²"}, {}, 404),
        ("POST", "/v1/embeddings", {"input": "a", "model": "tiny:١"}, {}, 404),
        ("GET", "/v1/models/tiny:%C2%B2", None, {}, 404),
        ("GET", "/v2/models/tiny/versions/%C2%B2", None, {}, 404),
        ("POST", "/v2/models/tiny/infer", {"inputs": []}, {"inference-header-content-length": "²"}, 400),
    ],
    ids=["id-2**63", "id-2**64-1", "kserve-id-2**63", "superscript", "arabic-indic", "get", "v2", "header"],
)
def test_numbers_that_python_reads_loosely_are_client_errors(
    srv: ServerThread, method: str, path: str, body: object, headers: dict[str, str], status: int
) -> None:
    """Found by hand, past the property tests above: each was a 500 (int() of "²", numpy of 2**63)."""
    data = None if body is None else json.dumps(body).encode()
    reply = request(method, url(srv, path), data, {"content-type": "application/json", **headers})
    assert reply.status == status, (reply.status, reply.body[:300])
    assert request("POST", url(srv, "/v1/embeddings"), {"input": "still here"}).status == 200


def test_kserve_binary_output_follows_the_request_flag_unless_the_output_says_otherwise(srv: ServerThread) -> None:
    """Triton's binary data extension: `binary_data_output` holds for every output, an output's own
    `binary_data` overrides it; a bad flag is refused before the model runs, as a failed request."""
    text = {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}

    def infer(parameters: dict[str, Any], outputs: list[dict[str, Any]]) -> Any:
        body = {"inputs": [text], "parameters": parameters, "outputs": outputs}
        return request("POST", url(srv, "/v2/models/tiny/infer"), body)

    def as_binary(reply: Any) -> bool:
        assert reply.status == 200, reply.body[:300]
        return "inference-header-content-length" in reply.headers

    named = {"name": "embeddings"}
    assert as_binary(infer({"binary_data_output": True}, []))
    assert as_binary(infer({"binary_data_output": True}, [named]))
    assert not as_binary(infer({"binary_data_output": True}, [named | {"parameters": {"binary_data": False}}]))
    assert as_binary(infer({}, [named | {"parameters": {"binary_data": True}}]))
    assert not as_binary(infer({}, [named]))

    def counts() -> tuple[int, int, int]:
        stats = request("GET", url(srv, "/v2/models/tiny/stats")).json()["model_stats"][0]
        return (
            stats["inference_stats"]["success"]["count"],
            stats["inference_stats"]["fail"]["count"],
            stats["inference_count"],
        )

    classes = infer({}, [named | {"parameters": {"classification": 3}}])  # tritonclient's class_count
    assert classes.status == 400 and "asks for classification" in classes.json()["error"]
    success, fail, embedded = counts()
    for bad in ({"binary_data_output": "yes"}, {}):
        outputs = [named | {"parameters": {"binary_data": 1}}] if not bad else []
        reply = infer(bad, outputs)
        assert reply.status == 400 and "must be a bool" in reply.json()["error"]
    assert counts() == (success, fail + 2, embedded)  # refused, and nothing computed for them


def test_kserve_parameters_set_to_null_are_unset_and_dimensions_shape_the_output(srv: ServerThread) -> None:
    """A client that writes an optional field it leaves unset as null (pydantic's models, Go's pointers) gets the
    defaults, as the OpenAI route reads `dimensions: null`: a null flag was refused 400 ("must be a bool, got
    NoneType") where a null prompt_name was unset. `dimensions` keeps the leading values, renormalised."""
    text = {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a null parameter"]}
    infer = url(srv, "/v2/models/tiny/infer")
    plain = request("POST", infer, {"inputs": [text]})
    keys = ("normalize", "truncate", "prompt_name", "dimensions", "binary_data_output")
    nulls = request("POST", infer, {"inputs": [text], "parameters": dict.fromkeys(keys)})
    assert plain.status == nulls.status == 200, nulls.body[:300]
    assert nulls.json()["outputs"] == plain.json()["outputs"]
    full = np.array(plain.json()["outputs"][0]["data"], dtype=np.float32)
    short = request("POST", infer, {"inputs": [text], "parameters": {"dimensions": 8}}).json()["outputs"][0]
    assert short["shape"] == [1, 8]
    np.testing.assert_allclose(short["data"], full[:8] / np.linalg.norm(full[:8]), atol=1e-6)
    for bad, says in (({"dimensions": 8.0}, "must be an integer, got float"), ({"dimensions": 0}, "ask for 1 to")):
        reply = request("POST", infer, {"inputs": [text], "parameters": bad})
        assert reply.status == 400 and says in reply.json()["error"], (bad, reply.body[:300])


def test_kserve_rest_cuts_a_long_text_by_default_unless_truncate_is_false(srv: ServerThread) -> None:
    """--auto-truncate is on by default (null is unset too); an explicit truncate false wins over it."""
    long = {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["word " * 400]}
    infer = url(srv, "/v2/models/tiny/infer")
    asked = request("POST", infer, {"inputs": [long], "parameters": {"truncate": True}})
    for parameters in ({}, {"truncate": None}):
        reply = request("POST", infer, {"inputs": [long], "parameters": parameters})
        assert reply.status == 200 and reply.json()["outputs"] == asked.json()["outputs"], reply.body[:300]
    refused = request("POST", infer, {"inputs": [long], "parameters": {"truncate": False}})
    assert refused.status == 400 and "1602 tokens long" in refused.json()["error"]


def test_responses_are_not_held_back_by_nagles_algorithm(srv: ServerThread) -> None:
    """Every accepted connection has TCP_NODELAY: without it each keep-alive response's body waited
    for the client's delayed ACK of its head, ~45 ms a request (found by the bench, 3x gRPC's latency)."""
    with socket.create_connection(("127.0.0.1", srv.server.http_port or 0), timeout=WAIT) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
        http = srv.server._http
        assert http is not None
        connections = list(http.server.server_state.connections)
        assert connections
        for protocol in connections:
            sock = protocol.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_the_request_id_goes_both_ways(srv: ServerThread) -> None:
    reply = request("POST", url(srv, "/v1/embeddings"), {"input": "a"}, {"x-request-id": "http-req-7"})
    assert reply.headers["x-request-id"] == "http-req-7"
    reply = request("POST", url(srv, "/v1/embeddings"), {"input": ""}, {"x-request-id": "http-req-8"})
    assert reply.status == 400 and reply.headers["x-request-id"] == "http-req-8"
    assert len(request("GET", url(srv, "/health")).headers["x-request-id"]) == 16  # made up when not sent
    # An id that could forge a log line's start (spaces, brackets) is replaced by one made up, as is a long one.
    for forged in ("abc] INFO mhaserve.service.server [-", "x" * 129):
        got = request("GET", url(srv, "/health"), headers={"x-request-id": forged}).headers["x-request-id"]
        assert got != forged and len(got) == 16
    uuid = "0f8fad5b-d9cb-469f-a165-70867728950e"
    assert request("GET", url(srv, "/health"), headers={"x-request-id": uuid}).headers["x-request-id"] == uuid


def test_the_open_inference_protocols_health_answers_have_its_bodies(srv: ServerThread) -> None:
    """The status says it (200 or 400), as Triton's do and tritonclient reads; the body too, in the protocol's
    shapes ($live_server_response, $ready_server_response, $ready_model_response), which KServe's own REST
    client parses: an empty body raised JSONDecodeError in its is_server_live and is_server_ready."""
    answers = {
        "/v2/health/live": (200, {"live": True}),
        "/v2/health/ready": (200, {"ready": True}),
        "/v2/models/tiny/ready": (200, {"name": "tiny", "ready": True}),
        "/v2/models/tiny/versions/1/ready": (200, {"name": "tiny", "ready": True}),
        "/v2/models/tiny/versions/9/ready": (400, {"name": "tiny", "ready": False}),
        "/v2/models/bogus/ready": (400, {"name": "bogus", "ready": False}),
    }
    for path, (status, body) in answers.items():
        reply = request("GET", url(srv, path))
        assert (reply.status, reply.json()) == (status, body), path
        assert reply.headers["content-type"] == "application/json", path


def test_http_routes_are_in_the_request_metrics(srv: ServerThread) -> None:
    port = srv.server.metrics_port
    assert port
    method = "POST /v1/embeddings"
    before = scrape(port)
    request("POST", url(srv, "/v1/embeddings"), {"input": ["a", "b"]})
    request("POST", url(srv, "/v1/embeddings"), {"input": []})
    request("GET", url(srv, "/no/such/route"))
    # probes are answers, not requests to count (as gRPC's health checks are not): "not ready" is no error
    for probe in ("/health", "/v2/health/ready", "/v2/models/tiny/ready", "/v2/models/bogus/ready"):
        assert request("GET", url(srv, probe)).status in (200, 400)

    def delta(name: str, **labels: str) -> float:
        return scrape(port).get(name, **labels) - before.get(name, **labels)

    wait_until(lambda: delta("mhaserve_request_duration_seconds_count", method=method) >= 2, "both requests counted")
    assert delta("mhaserve_requests_total", method=method, code="OK") == 1
    assert delta("mhaserve_requests_total", method=method, code="INVALID_ARGUMENT") == 1
    assert delta("mhaserve_requests_total", method="GET (no route)", code="NOT_FOUND") == 1
    for method in ("GET /health", "GET /v2/health/ready", "GET /v2/models/{model_name}/ready"):
        assert delta("mhaserve_requests_total", method=method) == 0, method
    # refused before its route ran (the body over the limit): still counted under the route it asked for
    before = scrape(port)
    too_big = b'{"input": "' + b"a" * (srv.server.settings.max_message_bytes + 1) + b'"}'
    assert (
        request("POST", url(srv, "/v2/models/tiny/infer"), too_big, {"content-type": "application/json"}).status == 413
    )
    wait_until(
        lambda: (
            delta("mhaserve_requests_total", method="POST /v2/models/{model_name}/infer", code="RESOURCE_EXHAUSTED")
            == 1
        ),
        "the refusal counted under its route",
    )
    assert scrape(port).get("mhaserve_requests_in_flight") == 0


def test_health_info_and_the_openapi_document(srv: ServerThread) -> None:
    assert request("GET", url(srv, "/health")).json() == {"status": "SERVING"}
    assert request("GET", url(srv, "/ping")).json() == {"status": "SERVING"}  # SageMaker's health check
    assert request("GET", url(srv, "/")).json() == {"status": "SERVING"}  # TEI's, and load balancers' default
    info = request("GET", url(srv, "/info")).json()
    assert (info["model"], info["version"], info["dimensions"], info["max_input_length"]) == ("tiny", 1, 32, 160)
    assert info["device"] == "CPUExecutionProvider" and info["limits"]["max_client_batch_size"] == 8
    assert info["server"]["name"] == "mhaserve" and [m["model"] for m in info["models"]] == ["tiny"]
    # text-embeddings-inference's fields too, of the default model (but `version`: the model's version here)
    assert info["model_type"] == {"embedding": {"pooling": info["pooling"]}} and info["served_model_name"] == "tiny"
    assert (info["model_id"], info["model_sha"], info["model_dtype"]) == (info["source"], info["sha256"], "float32")
    assert info["max_concurrent_requests"] == info["limits"]["max_queue_size"] and info["max_client_batch_size"] == 8
    assert info["max_batch_tokens"] == info["limits"]["max_batch_tokens"] and info["max_batch_requests"] is None
    assert info["auto_truncate"] is True  # as TEI's default
    assert info["tokenization_workers"] == 2  # a field TEI's Info requires
    document = request("GET", url(srv, "/openapi.json")).json()
    assert {"/v1/embeddings", "/v1/models", "/v2/models/{model_name}/infer", "/tokenize", "/info", "/health"} <= set(
        document["paths"]
    )
    body = document["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"] == "#/components/schemas/EmbeddingRequest"
    assert "input" in document["components"]["schemas"]["EmbeddingRequest"]["properties"]
    docs = request("GET", url(srv, "/docs"))
    assert docs.status == 200 and b"swagger" in docs.body.lower()


def test_tokenize_gives_ids_and_offsets_and_every_token_of_a_long_text(srv: ServerThread) -> None:
    (tokens,) = request("POST", url(srv, "/tokenize"), {"inputs": "hi there"}).json()
    assert tokens[0] == {"id": 2, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert tokens[-1]["text"] == "[SEP]" and tokens[-1]["special"]
    words = [t for t in tokens if not t["special"]]
    assert "".join("hi there"[t["start"] : t["stop"]] for t in words) == "hithere"
    # A token's text is the input's own characters, as text-embeddings-inference gives it: the vocabulary's
    # lower-cased, accent-stripped word pieces (h, ##e, ...) once.
    (tokens,) = request("POST", url(srv, "/tokenize"), {"inputs": "Héllo wörld", "add_special_tokens": False}).json()
    assert [t["text"] for t in tokens] == list("Héllowörld")
    assert all(t["text"] == "Héllo wörld"[t["start"] : t["stop"]] for t in tokens)
    # A text past the model's maximum: every token of it, as TEI answers (how long a document is, to split
    # it), where it was refused as an embedding is; refused past TEI's 250 characters a token of the maximum.
    long = "word " * 400
    (whole,) = request("POST", url(srv, "/tokenize"), {"inputs": [long]}).json()
    assert len(whole) == 2 + 4 * 400 and "".join(t["text"] for t in whole[1:-1]) == "word" * 400
    reply = request("POST", url(srv, "/tokenize"), {"inputs": ["a", "w" * (160 * 250 + 1)]})
    assert reply.status == 400, reply.body[:300]
    assert "input 1 is 40001 characters long; a text is tokenised whole up to 40000" in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == "inputs"  # this route's field, not the embeddings APIs' input
    reply = request("POST", url(srv, "/tokenize"), {"inputs": ["a"] * 9})
    assert reply.status == 400 and reply.json()["error"]["param"] == "inputs"
    reply = request("POST", url(srv, "/tokenize"), {"inputs": "a", "prompt_name": "nope"})
    assert reply.status == 400 and reply.json()["error"]["param"] == "prompt_name"
    (cut,) = request("POST", url(srv, "/tokenize"), {"inputs": [long], "truncate": True}).json()
    assert len(cut) == 160 and cut[:-1] == whole[:159]  # what the model sees
    # text-embeddings-inference's option, once taken and ignored (the answer kept [CLS] and [SEP])
    (bare,) = request("POST", url(srv, "/tokenize"), {"inputs": "hi there", "add_special_tokens": False}).json()
    assert bare == words


def test_a_large_tokenize_answer_is_made_off_the_event_loop(srv: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A /tokenize answer of many tokens is built (a Python object a token) and encoded on the tokeniser threads:
    on the event loop, one request within every limit (2,048 texts of 1,800 characters: 1.2 million tokens,
    80 MB of JSON) held every other client, health probes included, for 15 to 20 seconds (a review's finding).
    A small one is built where it is asked, as short texts are tokenised."""
    built: list[str] = []
    answer = tokens_module.answer

    def spy(*args: Any, **kwargs: Any) -> Any:
        built.append(threading.current_thread().name)
        return answer(*args, **kwargs)

    monkeypatch.setattr(tokens_module, "answer", spy)
    (small,) = request("POST", url(srv, "/tokenize"), {"inputs": "hi there"}).json()
    texts = ["word " * 30] * 8
    large = request("POST", url(srv, "/tokenize"), {"inputs": texts}).json()
    assert built[0] == srv.thread.name and built[1].startswith("tokenize"), built
    assert "".join(t["text"] for t in small) == "[CLS]hithere[SEP]"  # (the test model's vocabulary: characters)
    assert [len(t) for t in large] == [2 + 4 * 30] * 8
    assert large[0][2] == {"id": large[0][2]["id"], "text": "o", "special": False, "start": 1, "stop": 2}


def test_a_tokenize_answer_past_its_bound_is_refused(srv: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """One 4 MB /tokenize request within every limit (2,000 texts of 1,000 words) was answered with 2 million
    tokens, a Python dict each: 126 MB of JSON, 1.45 GB more memory at its peak, kept (a few at once took a 4 GB
    container down). The tokens of one answer are bounded (MAX_TOKENIZE_TOKENS), a 400 past it saying so."""
    monkeypatch.setattr(tokens_module, "MAX_TOKENIZE_TOKENS", 200)
    ok = request("POST", url(srv, "/tokenize"), {"inputs": ["word " * 20] * 2})  # 2 x 82 tokens
    assert ok.status == 200 and [len(t) for t in ok.json()] == [82, 82]
    reply = request("POST", url(srv, "/tokenize"), {"inputs": ["word " * 20] * 3})
    assert reply.status == 400, reply.body[:300]
    error = reply.json()["error"]
    assert error["param"] == "inputs" and error["message"] == (
        "the answer would hold 246 tokens; one tokenize request answers at most 200: send fewer or shorter inputs, "
        "or truncate"
    )


N = 200_000  # elements of a list (about 1 MB), every one bad, or all but one


@pytest.mark.parametrize(
    ("model", "body"),
    [
        ("openai.EmbeddingRequest", {"input": [1] * N + [1.5]}),
        ("openai.EmbeddingRequest", {"input": ["a"] * N + [1]}),
        ("openai.EmbeddingRequest", {"input": [[1.5] * N]}),
        ("tei.EmbedRequest", {"inputs": [1] * N + [None]}),
        ("tei.SimilarityRequest", {"inputs": {"source_sentence": "a", "sentences": [1] * N}}),
        ("utility.TokenizeRequest", {"inputs": [1] * N}),
        ("utility.DecodeRequest", {"ids": [1] * N + ["a"]}),
        ("kserve.rest.InferenceRequest", {"inputs": [{"name": "text", "shape": [1.5] * N, "datatype": "BYTES"}]}),
    ],
)
def test_a_long_list_with_a_bad_element_is_refused_at_it(model: str, body: dict[str, Any]) -> None:
    """A list is refused at its first bad element: pydantic made an error of each element that failed, for each
    member of the field's union where it has one (4 million for 2 million token ids and one float, 4 MB: 40 s of
    the event loop, most of it making those errors: a review's finding). One error a member of the union now."""
    import importlib

    from pydantic import ValidationError

    module, name = model.rsplit(".", 1)
    with pytest.raises(ValidationError) as e:
        getattr(importlib.import_module(f"mhaserve.service.{module}"), name).model_validate(body)
    assert e.value.error_count() <= 8, e.value.error_count()


def test_decode_gives_the_text_of_token_ids(srv: ServerThread) -> None:
    """`/decode` (TEI's) undoes `/tokenize`: the ids of a text give the text back, as the tokenizer decodes."""
    texts = ["hello world", "the quick brown fox"]
    ids = [[t["id"] for t in tokens] for tokens in request("POST", url(srv, "/tokenize"), {"inputs": texts}).json()]
    assert request("POST", url(srv, "/decode"), {"ids": ids}).json() == texts
    assert request("POST", url(srv, "/decode"), {"ids": ids[0]}).json() == texts[:1]
    (kept,) = request("POST", url(srv, "/decode"), {"ids": ids[0], "skip_special_tokens": False}).json()
    assert kept.startswith("[CLS]") and kept.endswith("[SEP]")
    assert request("POST", url(srv, "/decode"), {"ids": [], "model": "tiny:1"}).json() == [""]
    many = request("POST", url(srv, "/decode"), {"ids": [ids[1] * 30] * 8}).json()  # decoded off the event loop
    assert many == [" ".join([texts[1]] * 30)] * 8
    for body, status, message in (
        ({"ids": [[2, 3], [2, 300]]}, 400, "ids 1 has token id 300, outside the vocabulary [0, 256)"),
        ({"ids": [-1]}, 400, "ids 0 has token id -1"),
        ({"ids": [[2]] * 9}, 400, "9 inputs in one request; the limit is 8"),
        ({"ids": [[2], 3]}, 400, "ids: must be a list of token ids"),
        ({"ids": "hello"}, 400, "ids"),
        ({"ids": [2], "model": "nope"}, 404, "model 'nope' is not served here"),
    ):
        reply = request("POST", url(srv, "/decode"), body)
        assert reply.status == status and message in reply.json()["error"]["message"], (body, reply.body[:300])
        if status == 400:  # the field at fault is this route's (the count's was the embeddings API's `input` once)
            assert reply.json()["error"]["param"] == "ids", (body, reply.body[:300])
    still_serving(srv)


PARITY_BODIES: list[tuple[bytes, str]] = [
    (b'{"input": ["hello world", "a"], "model": "tiny", "encoding_format": "float"}', "application/json"),
    (b'{"input": "hello world", "encoding_format": "base64", "dimensions": 8}', "application/json"),
    (b'{"input": [[2, 3, 4], [5, 6]]}', "application/json"),
    (b'{"input": "hello"', "application/json"),  # not JSON
    (b'{"input": "hello"}', "text/plain"),  # not declared as JSON
    (b'{"input": []}', "application/json"),
    (b'{"input": 3}', "application/json"),  # no such shape: names the field
    (b'{"input": ""}', "application/json"),
    (b'{"input": "x", "model": "nope"}', "application/json"),
    (b'{"input": "x", "dimensions": 0}', "application/json"),
    (json.dumps({"input": "word " * 300, "truncate": False}).encode(), "application/json"),  # past the maximum
]


# The same kinds of body, in the same order, for TEI's routes: so the same statuses.
PARITY_STATUSES = [200, 200, 200, 400, 415, 400, 400, 400, 404, 400, 400]
TEI_PARITY_BODIES: list[tuple[bytes, str]] = [
    (
        json.dumps(
            {"inputs": ["hello world", "word " * 300], "truncate": True, "truncation_direction": "left"}
        ).encode(),
        "application/json",
    ),  # fmt: skip
    (b'{"inputs": "hello world", "dimensions": 8, "normalize": true}', "application/json"),
    (b'{"inputs": [[2, 3, 4], [5, 6]], "normalize": false}', "application/json"),
    (b'{"inputs": "hello"', "application/json"),  # not JSON
    (b'{"inputs": "hello"}', "text/plain"),  # not declared as JSON
    (b'{"inputs": []}', "application/json"),
    (b'{"inputs": 3}', "application/json"),
    (b'{"inputs": ""}', "application/json"),
    (b'{"inputs": "x", "model": "nope"}', "application/json"),
    (b'{"inputs": "x", "dimensions": 0}', "application/json"),
    (json.dumps({"inputs": "word " * 300, "truncate": False}).encode(), "application/json"),  # past the maximum
]

SIMILARITY = {"source_sentence": "hello world", "sentences": ["a", "b"]}
SIMILARITY_PARITY_BODIES: list[tuple[bytes, str]] = [
    (json.dumps({"inputs": SIMILARITY, "model": "tiny"}).encode(), "application/json"),
    (
        json.dumps({"inputs": SIMILARITY, "parameters": {"truncate": True, "truncation_direction": "left"}}).encode(),
        "application/json",
    ),  # fmt: skip
    (json.dumps({"inputs": SIMILARITY, "parameters": None}).encode(), "application/json"),
    (b'{"inputs": {"source_sentence": "hello"', "application/json"),  # not JSON
    (json.dumps({"inputs": SIMILARITY}).encode(), "text/plain"),  # not declared as JSON
    (b'{"inputs": {"source_sentence": "hello", "sentences": []}}', "application/json"),
    (b'{"inputs": {"source_sentence": "hello", "sentences": 3}}', "application/json"),
    (b'{"inputs": {"source_sentence": "", "sentences": ["a"]}}', "application/json"),
    (json.dumps({"inputs": SIMILARITY, "model": "nope"}).encode(), "application/json"),
    (json.dumps({"inputs": SIMILARITY, "parameters": {"truncation_direction": "middle"}}).encode(), "application/json"),
    (
        json.dumps(
            {"inputs": {"source_sentence": "word " * 300, "sentences": ["a"]}, "parameters": {"truncate": False}}
        ).encode(),
        "application/json",
    ),
]


@pytest.mark.parametrize(
    ("path", "bodies", "statuses"),
    [
        ("/v1/embeddings", PARITY_BODIES, PARITY_STATUSES),
        ("/embeddings", PARITY_BODIES, PARITY_STATUSES),
        ("/embed", TEI_PARITY_BODIES, PARITY_STATUSES),
        ("/", TEI_PARITY_BODIES, PARITY_STATUSES),
        ("/invocations", TEI_PARITY_BODIES, PARITY_STATUSES),
        ("/similarity", SIMILARITY_PARITY_BODIES, PARITY_STATUSES),
        ("/", SIMILARITY_PARITY_BODIES, PARITY_STATUSES),
    ],
)
def test_the_fast_embeddings_routes_answer_as_the_documented_routes_do(
    srv: ServerThread, path: str, bodies: list[tuple[bytes, str]], statuses: list[int]
) -> None:
    """POST /v1/embeddings (and /embeddings) and TEI's POST /embed and /similarity (and / and /invocations,
    either) are answered by the middleware itself, past FastAPI (service/http/middleware.py); FastAPI keeps the
    routes for the OpenAPI document. Both must answer every request alike: each body above goes through the
    socket (the fast route) and straight into the FastAPI app."""
    assert srv.server._http is not None
    middleware = srv.server._http.config.app
    assert isinstance(middleware, CallMiddleware)
    framework = middleware.app

    async def through_framework(body: bytes, content_type: str) -> tuple[int, dict[bytes, bytes], bytes]:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[MutableMapping[str, Any]] = []

        async def receive() -> dict[str, object]:
            return messages.pop() if messages else {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        await framework(scope, receive, send)
        start = sent[0]
        headers = dict(start["headers"])
        return start["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])

    def rows(answer: Any) -> list[Any]:
        return [d["embedding"] for d in answer["data"]] if isinstance(answer, dict) else list(answer)

    for body, content_type in bodies:
        fast = request("POST", url(srv, path), body, headers={"content-type": content_type})
        status, headers, slow = srv.call(through_framework(body, content_type))
        assert (fast.status, fast.headers["content-type"]) == (status, headers[b"content-type"].decode()), body
        if status == 200:
            got, want = json.loads(fast.body), json.loads(slow)
            if isinstance(got, dict):
                assert got["usage"] == want["usage"] and got["model"] == want["model"], body
            for a, b in zip(rows(got), rows(want), strict=True):
                if isinstance(a, str):
                    assert a == b, body
                else:  # a vector, or a similarity
                    assert np.max(np.abs(np.subtract(a, b))) <= 1e-6, body
        else:
            assert fast.body == slow, body
    assert [request("POST", url(srv, path), b, headers={"content-type": t}).status for b, t in bodies] == statuses


# ---- random connections: requests pipelined, split anywhere, chunked or not, and clients that leave -----------

CONNECTIONS = int(os.environ.get("HTTP_CONNECTIONS", "60"))  # examples a run; more by hand
_GOOD = (b'{"input": ["a text", "another"], "model": "tiny"}', 200)
_BAD = (b'{"input": 5, "model": "tiny"}', 400)
_UNKNOWN = (b'{"input": "a", "model": "nope"}', 404)


def _message(body: bytes, chunked: bool, chunk: int) -> bytes:
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if not chunked:
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    parts = [body[i : i + chunk] for i in range(0, len(body), chunk)]
    return (
        head
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
        + b"0\r\n\r\n"
    )


def _responses(s: socket.socket, n: int) -> list[int]:
    """The statuses of the next `n` responses on a keep-alive connection (each read whole)."""
    data, statuses = b"", list[int]()
    while len(statuses) < n:
        while b"\r\n\r\n" not in data:
            got = s.recv(65536)
            assert got, f"the connection closed after {len(statuses)} responses of {n}"
            data += got
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        statuses.append(int(lines[0].split()[1]))
        length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:"))
        while len(data) < length:
            got = s.recv(65536)
            assert got, "the connection closed in a response's body"
            data += got
        data = data[length:]
    return statuses


@hsettings(max_examples=CONNECTIONS, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(
        st.tuples(st.sampled_from([_GOOD, _GOOD, _BAD, _UNKNOWN]), st.booleans(), st.integers(1, 20)),
        min_size=1,
        max_size=5,
    ),
    cuts=st.lists(st.integers(1, 60), max_size=6),
    leave=st.sampled_from([None, None, "sent", "mid"]),
)
def test_pipelined_requests_split_anywhere_are_answered_in_order_and_a_client_that_leaves_leaves_nothing(
    srv: ServerThread, requests: list[tuple[tuple[bytes, int], bool, int]], cuts: list[int], leave: str | None
) -> None:
    """One keep-alive connection: requests (good, invalid, of an unknown model; Content-Length or chunked in
    chunks of any size) pipelined, the bytes sent in pieces cut anywhere. Read whole, each gets its own status
    in order; a client that leaves after sending them all, or in the middle of one, leaves no request in
    flight, and the server goes on serving."""
    wire = b"".join(_message(body, chunked, chunk) for (body, _), chunked, chunk in requests)
    if leave == "mid":
        wire = wire[: len(wire) // 2]
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as s:
        at = 0
        for cut in cuts:
            s.sendall(wire[at : at + cut])
            at += cut
            time.sleep(0.001)
        s.sendall(wire[at:])
        if leave is None:
            assert _responses(s, len(requests)) == [status for (_, status), _, _ in requests]
    port = srv.server.metrics_port
    assert port
    wait_until(lambda: scrape(port).get("mhaserve_requests_in_flight") == 0, "no request left in flight")
    still_serving(srv)


def test_a_large_body_is_parsed_without_starting_a_collection() -> None:
    """Each of a body's arrays is a tracked container, and every 700 started a collection of the young heap:
    300,000 token-id lists took 210-270 ms to parse on the event loop, 53-58 ms without. Small bodies are
    parsed as they come, and a collector disabled before stays disabled."""
    import gc

    started: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    large = json.dumps({"input": [[2, 5, 3]] * 20_000}).encode()
    small = json.dumps({"input": [[2, 5, 3]] * 1_000}).encode()
    assert len(small) < PAUSE_COLLECTOR_BYTES < len(large)
    gc.callbacks.append(note)
    try:
        assert len(parse_json(large, "application/json")["input"]) == 20_000
        assert started == [] and gc.isenabled()
        parse_json(small, None)
        assert started  # 1,000 lists: the collector ran as usual
        gc.disable()
        parse_json(large, None)
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.callbacks.remove(note)


@contextlib.contextmanager
def _stoppable_server(
    connection_limit: ConnectionLimit | None = None,
) -> Iterator[tuple[asyncio.AbstractEventLoop, HttpServer, int]]:
    """An HttpServer answering 200 "ok", on a loop of its own thread, with uvicorn's ticks ended beforehand (the
    stop waits for them first, a turn of up to 0.1 s): a stop's first step then stops the listener at once."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = HttpServer(app, host="127.0.0.1", port=0, read_timeout=5.0, connection_limit=connection_limit)
    port = server.bind()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(WAIT)
    try:
        server.server.should_exit = True
        assert server._ticks is not None
        asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(server._ticks), 5), loop).result(WAIT)
        yield loop, server, port
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT)
        loop.close()


@pytest.mark.parametrize("limit", [None, 2])
def test_connections_the_kernel_holds_unaccepted_when_the_stop_begins_are_answered_503(limit: int | None) -> None:
    """Connections whose handshake the kernel had completed but the server not yet accepted (its loop busy) when a
    stop began were reset as the listener closed, their requests already sent: a client cannot tell such a reset
    from a request lost in the middle, and proxies retry only refused connects or idempotent requests. They are
    accepted before the listener closes, and answered 503 "shutting down" with Retry-After and connection: close,
    as a request arriving during a drain is; past --max-connections too (answered as those over it are, each
    place given back). Here the clients connect and send from the loop's own thread, which the stop then follows
    without a turn between."""
    connection_limit = ConnectionLimit(limit) if limit is not None else None
    clients: list[socket.socket] = []
    with _stoppable_server(connection_limit) as (loop, server, port):

        async def connect_then_stop() -> None:
            for _ in range(3):  # a blocking connect to loopback completes in the kernel, without the loop
                raw = socket.create_connection(("127.0.0.1", port), timeout=5)
                raw.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: test\r\nContent-Length: 2\r\n\r\n{}")
                clients.append(raw)
            await server.stop(0)

        asyncio.run_coroutine_threadsafe(connect_then_stop(), loop).result(WAIT)
        for raw in clients:
            received = b""
            try:
                while chunk := raw.recv(4096):  # ends: the server closes its end of the connection
                    received += chunk
            except ConnectionResetError:
                pytest.fail(f"reset after {received!r}")
            head, _, body = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503"), received
            assert b"\r\nretry-after: 1" in head.lower() and b"\r\nconnection: close" in head, head
            assert b"shutting down" in body, body
        if connection_limit is not None:
            wait_until(lambda: connection_limit.open == connection_limit.answering == 0, "every place given back")
        for raw in clients:
            raw.close()


def test_a_connection_accepted_in_the_turn_before_the_stop_is_answered_or_closed() -> None:
    """As the lean gRPC front's (test_lean_front.py): asyncio makes an accepted socket's transport a turn after the
    accept, and a stop that closed asyncio's Server in between left that socket open and unread (Python 3.11's
    Server._attach fails the transport; asyncio drops the error), its client waiting for its own timeout. Here
    the loop is held while the client connects and the stop is sent, so that the two fall in turns next to each
    other: the request is answered at once, 503 "shutting down" (its connection made after the stop began)."""
    with _stoppable_server() as (loop, server, port):  # the stop's first step stops the listener, a turn after
        held = threading.Event()

        def hold() -> None:
            held.set()
            time.sleep(0.3)  # the client connects and the stop is sent meanwhile

        loop.call_soon_threadsafe(hold)
        assert held.wait(5)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
            stopped = asyncio.run_coroutine_threadsafe(server.stop(0), loop)
            received = b""
            try:
                while chunk := raw.recv(4096):  # ends: the server closes the connection
                    received += chunk
            except ConnectionResetError:
                pass
            except TimeoutError:
                pytest.fail(f"no answer nor end of the connection within 5 s; received {received!r}")
        stopped.result(WAIT)
        assert received.startswith(b"HTTP/1.1 503") and b"shutting down" in received, received


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"input": [""], "model": "tiny"}),
        ("/v1/embeddings", {"input": "x", "model": "tiny", "encoding_format": "xx"}),
        ("/v1/embeddings", {"input": "x", "model": "tiny", "dimensions": "2"}),
        ("/embed", {"inputs": "", "model": "tiny"}),
        ("/embed", {"inputs": "x", "model": "tiny", "truncation_direction": "middle"}),
        ("/similarity", {"inputs": {"source_sentence": "a", "sentences": []}, "model": "tiny"}),
        ("/invocations", {"inputs": [""]}),
    ],
    ids=["empty-text", "encoding-format", "dimensions-string", "tei-empty", "tei-direction", "no-sentences", "root"],
)
def test_a_refused_request_that_names_a_model_is_counted_as_its_failure(
    srv: ServerThread, path: str, body: dict[str, Any]
) -> None:
    """KServe's statistics and the model's metrics count requests "refused or failed after naming this model and
    version" (docs/kserve.md); these, refused at the edge before the pipeline, were counted in neither (a
    user-test's finding), where a bad KServe tensor was."""

    def fails() -> tuple[int, float]:
        stats = request("GET", url(srv, "/v2/models/tiny/stats")).json()["model_stats"][0]
        metric = srv.samples().get("mhaserve_model_requests_total", model="tiny", code="INVALID_ARGUMENT") or 0
        return stats["inference_stats"]["fail"]["count"], metric

    before = fails()
    assert request("POST", url(srv, path), body).status == 400
    assert fails() == (before[0] + 1, before[1] + 1)


def _until_closed(s: socket.socket) -> bytes:
    answer = b""
    while chunk := s.recv(65536):  # b"" once the server closes; a timeout if it never does
        answer += chunk
    return answer


@pytest.mark.parametrize("upgrade", ["websocket", "h2c"])
def test_an_upgrade_is_not_taken_and_its_connection_ends_after_the_answer(srv: ServerThread, upgrade: str) -> None:
    """A request asking to upgrade: this server serves no WebSocket and no h2c. uvicorn took a WebSocket upgrade
    itself (a 403 in plain text, the connection handed to another protocol that never gave back its place in
    --max-connections: a few such requests, no key needed, locked every client out), and served a POST asking for
    h2c (`curl --http2 http://...`) with an empty body, what followed it on the connection never read (a review's
    findings). A request without a body is served, and its connection closed after it; one with a body, whose
    bytes the parser no longer reads, is refused 400 saying why."""
    port = srv.server.metrics_port
    assert port
    before = scrape(port).get("mhaserve_connections", protocol="http")
    asks = f"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: {upgrade}\r\nSec-WebSocket-Key: dGhlIHNhbXBsZQ==\r\n"
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=10 * READ_TIMEOUT) as s:
        s.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\n{asks}\r\n".encode())
        answer = _until_closed(s)
    assert answer.startswith(b"HTTP/1.1 200 OK") and b"connection: close" in answer, answer[:300]
    assert b"x-request-id" in answer and answer.endswith(b"}")
    body = b'{"input": "hello"}'
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=10 * READ_TIMEOUT) as s:
        head = f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n{asks}Content-Type: application/json\r\n"
        s.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body + b"GET /health HTTP/1.1\r\n\r\n")
        answer = _until_closed(s)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request") and b"connection: close" in answer, answer[:300]
    assert b"without Upgrade" in answer and b"SERVING" not in answer  # nor the GET after it: unread
    wait_until(lambda: scrape(port).get("mhaserve_connections", protocol="http") == before, "their places back")
    still_serving(srv)


def test_a_blank_line_after_a_request_does_not_hold_the_connection_open(srv: ServerThread) -> None:
    """An empty line before a request line is skipped, as RFC 9112 2.2 allows; uvicorn stopped the keep-alive
    timer for any bytes and armed nothing, so one CRLF after a request held the connection (and its place in
    --max-connections) for as long as the client liked (a review's finding). The header deadline holds."""
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=10 * READ_TIMEOUT) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b"}"):
            answer += s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200")
        s.sendall(b"\r\n")
        assert _until_closed(s) == b""


def _json_lines(srv: ServerThread, lines: int, *, receive_buffer: int) -> socket.socket:
    """A connection that has sent a JSON Lines body of `lines` requests of 8 texts, with a small receive buffer."""
    line = orjson.dumps({"inputs": [f"text number {i}" for i in range(8)], "model": "tiny"})
    body = b"\n".join([line] * lines)
    head = (
        f"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/jsonlines\r\nContent-Length: {len(body)}"
    )
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    s.settimeout(60)
    s.connect(("127.0.0.1", srv.server.http_port))
    s.sendall(head.encode() + b"\r\n\r\n" + body)
    return s


def test_a_client_that_takes_none_of_its_answer_is_cut_and_its_request_ends(srv: ServerThread) -> None:
    """A JSON Lines body whose answer (megabytes) its client never reads: uvicorn waited for the buffer to drain
    with no deadline, and the request stayed in flight, its connection open, its answer in memory, as long as
    the client kept the socket (a review's finding). Nothing taken for --http-header-timeout ends it."""
    port = srv.server.metrics_port
    assert port
    with _json_lines(srv, 3000, receive_buffer=4096) as s:  # about 8 MB of answer
        wait_until(lambda: scrape(port).get("mhaserve_requests_in_flight") == 1, "the request in flight")
        wait_until(lambda: scrape(port).get("mhaserve_requests_in_flight") == 0, "the request ended", timeout=60)
        with contextlib.suppress(ConnectionResetError):
            while s.recv(1 << 20):  # what the kernel held before the cut, then the end (a timeout if none came)
                pass
    still_serving(srv)


def test_a_client_that_reads_its_answer_slowly_is_not_cut(srv: ServerThread) -> None:
    """The other side of the cut above: a client on a slow link, reading a little at a time, gets its answer
    whole, however long it is held past the high-water mark."""
    with _json_lines(srv, 2000, receive_buffer=16384) as s:  # about 5 MB, past what the kernel's buffers take
        answer = bytearray()
        while not answer.endswith(b"\r\n0\r\n\r\n"):  # the chunked answer's end
            chunk = s.recv(16 << 10)  # 800 KB/s: the server's transport held past its high-water mark for seconds
            assert chunk, f"cut after {len(answer)} bytes"
            answer += chunk
            time.sleep(0.02)
    assert answer.count(b"\n[[") + answer.count(b"\r\n[[") >= 1 and b"HTTP/1.1 200" in answer[:20]


def test_an_upgrade_with_a_body_pipelined_behind_a_request_is_refused_after_its_answer(srv: ServerThread) -> None:
    """The 400 for an Upgrade with a body was written at once, ahead of the answer owed to the request before it
    on the connection, whose answer then failed (a review's finding): it comes after, as a 431 does."""
    body = b'{"input": "hello"}'
    first = f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    second = first + "\r\nConnection: Upgrade\r\nUpgrade: h2c"
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=10 * READ_TIMEOUT) as s:
        s.sendall(first.encode() + b"\r\n\r\n" + body + second.encode() + b"\r\n\r\n" + body)
        answer = _until_closed(s)
    assert answer.startswith(b"HTTP/1.1 200 OK"), answer[:300]
    assert answer.count(b"HTTP/1.1 400 Bad Request") == 1 and b"without Upgrade" in answer


def test_a_single_large_answer_read_slowly_past_the_keep_alive_time_arrives_whole(
    start: Callable[..., ServerThread], settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer written whole at once (megabytes of vectors), which its client is still reading when the
    connection's keep-alive time ends (1 s here, 5 s by default): it was aborted there with the rest unsent (the
    second review of the cut above). The close waits for a client that takes it, however slowly."""
    monkeypatch.setattr("mhaserve.service.http.server.KEEP_ALIVE_S", 1)
    many = dataclasses.replace(
        settings,
        http_port=free_port(),
        max_client_batch_size=16384,
        max_queue_size=16384,
        http_header_timeout=READ_TIMEOUT,
    )
    srv = start(many)
    body = orjson.dumps({"input": [[5]] * 16384, "model": "tiny"})  # about 6 MB of answer
    head = f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        s.settimeout(60)
        s.connect(("127.0.0.1", srv.server.http_port))
        s.sendall(head.encode() + b"\r\n\r\n" + body)
        answer = bytearray()
        started = time.monotonic()
        while not answer.endswith(b"}}"):  # the usage object ends the body
            chunk = s.recv(16 << 10)  # 800 KB/s: the kernel's buffers full for seconds past the keep-alive time
            assert chunk, f"cut after {len(answer)} bytes"
            answer += chunk
            time.sleep(0.02)
    assert time.monotonic() - started > 3  # past the keep-alive time
    head_end = answer.index(b"\r\n\r\n") + 4
    assert len(orjson.loads(answer[head_end:])["data"]) == 16384
