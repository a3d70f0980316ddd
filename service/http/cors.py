"""Calls from web pages of other origins (CORS): `--cors-allow-origin`, off unless origins are named.

A browser lets a page read an answer from another origin only where the answer says so, and before a POST with a
JSON body or an Authorization header it asks first (a preflight: OPTIONS with Access-Control-Request-Method). The
server answers every request alike either way; CORS decides what the page may read. text-embeddings-inference
has the same flag (`--cors-allow-origin`); without it a page's call fails in the browser with a CORS error, the
preflight answered 405 here (401 with API keys).

With origins named (or `*`), Starlette's CORS middleware stands in front of everything else:
- a preflight from an allowed origin is answered here, 200, before the API key check: browsers send it without
  credentials, by the Fetch standard; it is not counted in the metrics, as health probes are not. One from
  another origin is answered 400 (its page cannot call); an OPTIONS that is no preflight goes on to the routes;
- every answer of the API to an allowed origin says so, errors included: a 401 or a 429 the page cannot read
  would show only as a CORS failure in the browser's console, not as what went wrong (those written before a
  request is read, a 503 past --max-connections, a 431, have none: nothing here sees them);
- a preflight's answer gets the request id, and `connection: close` where a body came with it (`_Preflights`);
- a public page may call a server on a private address (Chrome's Private Network Access asks in the preflight);
- every request header is allowed: the keys are bearer tokens, never cookies (no credentials mode), and
  OpenAI's JavaScript client sends headers of its own (`x-stainless-*`) that a fixed list would refuse;
- the headers a client reads are exposed: the request id, Retry-After (of a 429 or 503), and
  text-embeddings-inference's timing headers.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mhaserve.service.context import REQUEST_ID_HEADER, accept_request_id
from mhaserve.service.http.middleware import has_body, header
from mhaserve.service.tei_timing import DESCRIPTIONS as TIMING_HEADERS

METHODS = ("GET", "POST")
EXPOSED = (REQUEST_ID_HEADER, "retry-after", *TIMING_HEADERS)
# How long a browser may keep a preflight's answer: the most Chromium keeps one (2 hours; Firefox 24 hours).
MAX_AGE_S = 7200


def allowing(app: ASGIApp, origins: Sequence[str]) -> ASGIApp:
    """`app` answering calls from pages of `origins` (`*`: any), as the module's docstring says."""
    return _Preflights(
        CORSMiddleware(
            app,
            allow_origins=origins,
            allow_methods=METHODS,
            allow_headers=["*"],
            # A page on the public internet calling a server on a private address: Chrome asks leave for that in
            # the preflight (Private Network Access); an operator who named the origin has given it.
            allow_private_network=True,
            expose_headers=EXPOSED,
            max_age=MAX_AGE_S,
        )
    )


class _Preflights:
    """The preflights the CORS middleware answers itself, before the call middleware, given what that gives every
    answer: the request id, and `connection: close` where a body came with it. Such a body is not read, and a
    connection left open would read on, each byte of it restarting uvicorn's keep-alive timer: a client without
    a key could hold a connection (and its place under --max-connections) for as long as it trickled."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "OPTIONS":
            await self.app(scope, receive, send)
            return
        if header(scope, b"origin") is None or header(scope, b"access-control-request-method") is None:
            await self.app(scope, receive, send)  # no preflight: on to the routes (a 405 there)
            return
        rid = accept_request_id(header(scope, REQUEST_ID_HEADER.encode()))  # the first, as the call middleware's
        body = has_body(scope)

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [(REQUEST_ID_HEADER.encode(), rid.encode())] + ([(b"connection", b"close")] if body else [])
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, marked)
