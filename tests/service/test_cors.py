"""Calls from web pages of other origins (`--cors-allow-origin`): what a browser asks and reads, on real sockets.

A browser is not at hand; its side of CORS is the Fetch standard's, so these send what a browser sends (the
Origin header, a preflight's OPTIONS with Access-Control-Request-*) and check the headers it would read."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mhaserve.cli.options import build
from mhaserve.service.settings import ApiKeys, Settings, SettingsError
from mhaserve.testing.http import request
from mhaserve.testing.loopback import WAIT
from mhaserve.testing.server import ServerThread, local_settings

KEY = "a-cors-test-key"
PAGE = "https://app.example.com"
# What OpenAI's JavaScript client asks to send from a browser (dangerouslyAllowBrowser), besides its key.
OPENAI_JS_HEADERS = "authorization, content-type, x-stainless-os, x-stainless-lang, x-stainless-retry-count"


@pytest.fixture(scope="module")
def srv(tiny_repo: Path) -> Iterator[ServerThread]:
    settings = local_settings(tiny_repo, cors_allow_origin=(PAGE,), api_keys=ApiKeys((KEY,)))
    with ServerThread(settings).ready() as server:
        yield server


def preflight(
    srv: ServerThread, path: str, origin: str, headers: str = "authorization, content-type"
) -> dict[str, Any]:
    reply = request(
        "OPTIONS",
        srv.http_url + path,
        headers={"origin": origin, "access-control-request-method": "POST", "access-control-request-headers": headers},
    )
    return {"status": reply.status, **reply.headers}


def test_a_preflight_from_an_allowed_origin_is_answered_without_a_key(srv: ServerThread) -> None:
    got = preflight(srv, "/v1/embeddings", PAGE, OPENAI_JS_HEADERS)
    assert got["status"] == 200
    assert got["access-control-allow-origin"] == PAGE
    assert {"GET", "POST"} <= {m.strip() for m in got["access-control-allow-methods"].split(",")}
    # every header the page asked for, OpenAI's client's own included
    allowed = {h.strip().lower() for h in got["access-control-allow-headers"].split(",")}
    assert {h.strip() for h in OPENAI_JS_HEADERS.split(",")} <= allowed
    assert int(got["access-control-max-age"]) > 0
    assert "access-control-allow-credentials" not in got  # keys are bearer tokens, never cookies


def test_a_preflight_from_another_origin_is_refused(srv: ServerThread) -> None:
    got = preflight(srv, "/v1/embeddings", "https://elsewhere.example.org")
    assert got["status"] == 400 and "access-control-allow-origin" not in got


def test_answers_to_an_allowed_origin_say_so_errors_included(srv: ServerThread) -> None:
    body = {"input": ["a page's text"], "model": "tiny"}
    ok = request("POST", srv.http_url + "/v1/embeddings", body, {"origin": PAGE, "authorization": f"Bearer {KEY}"})
    assert ok.status == 200 and len(ok.json()["data"]) == 1
    assert ok.headers["access-control-allow-origin"] == PAGE and "origin" in ok.headers["vary"].lower()
    exposed = {h.strip().lower() for h in ok.headers["access-control-expose-headers"].split(",")}
    assert {"x-request-id", "retry-after", "x-compute-time", "x-inference-time"} <= exposed
    # the page can read why it was refused, not only that CORS failed
    refused = request("POST", srv.http_url + "/v1/embeddings", body, {"origin": PAGE})
    assert refused.status == 401 and refused.headers["access-control-allow-origin"] == PAGE
    assert "error" in refused.json()
    # TEI's route too, with its timing headers for the page to read
    tei = request("POST", srv.http_url + "/embed", {"inputs": "x"}, {"origin": PAGE, "authorization": f"Bearer {KEY}"})
    assert tei.status == 200 and tei.headers["access-control-allow-origin"] == PAGE and "x-compute-time" in tei.headers


def test_another_origin_is_answered_without_leave_to_read(srv: ServerThread) -> None:
    """The server answers as to any client (a non-browser client sends what Origin it likes); the browser keeps
    the answer from the page."""
    reply = request(
        "POST",
        srv.http_url + "/v1/embeddings",
        {"input": "x", "model": "tiny"},
        {"origin": "https://elsewhere.example.org", "authorization": f"Bearer {KEY}"},
    )
    assert reply.status == 200 and "access-control-allow-origin" not in reply.headers


def test_preflights_are_not_counted_as_requests(srv: ServerThread) -> None:
    for _ in range(3):
        assert preflight(srv, "/v1/embeddings", PAGE)["status"] == 200
    request("POST", srv.http_url + "/v1/embeddings", {"input": "x"}, {"authorization": f"Bearer {KEY}"})
    methods = {s.labels["method"] for s in srv.samples() if s.name == "mhaserve_requests_total"}
    assert "POST /v1/embeddings" in methods and not [m for m in methods if m.startswith("OPTIONS")]


def test_off_by_default(tiny_repo: Path) -> None:
    with ServerThread(local_settings(tiny_repo)).ready() as plain:
        got = preflight(plain, "/v1/embeddings", PAGE)
        assert got["status"] == 405 and "access-control-allow-origin" not in got
    with ServerThread(local_settings(tiny_repo, api_keys=ApiKeys((KEY,)))).ready() as keyed:
        assert preflight(keyed, "/v1/embeddings", PAGE)["status"] == 401  # the key checked first, as on any route


def test_any_origin(tiny_repo: Path) -> None:
    with ServerThread(local_settings(tiny_repo, cors_allow_origin="*")).ready() as anyone:
        assert preflight(anyone, "/v1/embeddings", "http://localhost:5173")["access-control-allow-origin"] == "*"
        reply = request("POST", anyone.http_url + "/v1/embeddings", {"input": "x"}, {"origin": "null"})
        assert reply.status == 200 and reply.headers["access-control-allow-origin"] == "*"


def test_origins_from_flags_and_the_environment() -> None:
    flags = build({"cors_allow_origin": [("https://a.example",), ("http://localhost:3000",)]}, env={})
    assert flags.cors_allow_origin == ("https://a.example", "http://localhost:3000")
    env = build({}, env={"MHASERVE_CORS_ALLOW_ORIGIN": "https://a.example, https://b.example:8443"})
    assert env.cors_allow_origin == ("https://a.example", "https://b.example:8443")
    assert Settings().cors_allow_origin == ()


@pytest.mark.parametrize(
    "origin",
    [
        "https://app.example.com/",
        "https://app.example.com/embed",
        "app.example.com",
        "ftp://app.example.com",
        "https://",
        "https://user@app.example.com",
        "https://app.example.com:",
        "https://app.example.com:99999",
        "null",
        "https://straße.de",  # IDNA's versions differ on it: written in punycode, as browsers send it
        "http://127.1",  # browsers send 127.0.0.1
        "https://exa mple.com",
        "http://[fe80::1%25eth0]",
        "https://[::1",
    ],
)
def test_what_is_not_an_origin_is_refused(origin: str) -> None:
    """A browser's Origin header is scheme://host[:port]: a path, even a trailing slash, would match nothing."""
    with pytest.raises(SettingsError, match="not an origin"):
        Settings(cors_allow_origin=(origin,))
    with pytest.raises(SettingsError, match=f"^MHASERVE_CORS_ALLOW_ORIGIN: '{re.escape(origin)}' is not an origin"):
        build({}, env={"MHASERVE_CORS_ALLOW_ORIGIN": origin})


def test_an_origin_is_written_as_a_browser_sends_it() -> None:
    """Browsers send the scheme and host in lower case, a non-ASCII host in punycode and no default port; the
    comparison is exact, so `https://App.Example.com:443` as given would match no page."""
    given = (
        "HTTPS://App.Example.com:443",
        "http://xn--bcher-kva.example:80",
        "http://[fe80:0::1]:8080",
        " https://a.b ",
    )
    assert Settings(cors_allow_origin=given).cors_allow_origin == (
        "https://app.example.com",
        "http://xn--bcher-kva.example",
        "http://[fe80::1]:8080",
        "https://a.b",
    )
    for nothing in (",", " , "):  # meant to name origins, names none: refused, as --model's is
        with pytest.raises(SettingsError, match="names no origin"):
            build({}, env={"MHASERVE_CORS_ALLOW_ORIGIN": nothing})
    assert [name for name, _ in Settings(cors_allow_origin=("*",), http_port=0).inert()] == ["cors_allow_origin"]


def test_a_preflight_with_a_body_closes_its_connection(srv: ServerThread) -> None:
    """The preflight's answer comes before the call middleware, which reads (and bounds in time) every body: one
    sent with a preflight is not read, so its connection closes after the answer, as a refused request's does,
    rather than stay open as long as its sender trickles it. The answer has its request id, as every answer."""
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT) as conn:
        conn.sendall(
            b"OPTIONS /v1/embeddings HTTP/1.1\r\nhost: x\r\norigin: " + PAGE.encode() + b"\r\n"
            b"access-control-request-method: POST\r\nx-request-id: pre-1\r\nx-request-id: pre-2\r\n"
            b"content-length: 1000\r\n\r\nab"
        )
        head = conn.recv(65536).split(b"\r\n\r\n")[0].decode().lower()
        assert head.startswith("http/1.1 200") and "connection: close" in head and "x-request-id: pre-1" in head
        while conn.recv(65536):  # the server closes it: read to the end
            pass
    plain = preflight(srv, "/v1/embeddings", PAGE)
    assert plain["status"] == 200 and "connection" not in plain and plain["x-request-id"]


def test_a_page_on_the_internet_may_call_a_server_on_a_private_address(srv: ServerThread) -> None:
    """Chrome's Private Network Access: a public page's preflight to a private or loopback address asks for leave;
    an origin the operator named has it."""
    reply = request(
        "OPTIONS",
        srv.http_url + "/v1/embeddings",
        headers={
            "origin": PAGE,
            "access-control-request-method": "POST",
            "access-control-request-private-network": "true",
        },
    )
    assert reply.status == 200 and reply.headers["access-control-allow-private-network"] == "true"
