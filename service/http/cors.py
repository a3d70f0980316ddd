"""Calls from web pages of other origins (CORS): `--cors-allow-origin`, off unless origins are named.

A browser lets a page read an answer from another origin only where the answer says so, and before a POST with a
JSON body or an Authorization header it asks first (a preflight: OPTIONS with Access-Control-Request-Method). The
server answers every request alike either way; CORS decides what the page may read. text-embeddings-inference
has the same flag (`--cors-allow-origin`); without it a page's call fails in the browser with a CORS error, the
preflight answered 405 here.

With origins named (or `*`), Starlette's CORS middleware stands in front of everything else:
- a preflight from an allowed origin is answered here, 200, before the API key check: browsers send it without
  credentials, by the Fetch standard; it is not counted in the metrics, as health probes are not. One from
  another origin is answered 400 (its page cannot call); an OPTIONS that is no preflight goes on to the routes;
- every answer to an allowed origin says so, errors included: a 401 or a 429 the page cannot read would show
  only as a CORS failure in the browser's console, not as what went wrong;
- every request header is allowed: the keys are bearer tokens, never cookies (no credentials mode), and
  OpenAI's JavaScript client sends headers of its own (`x-stainless-*`) that a fixed list would refuse;
- the headers a client reads are exposed: the request id, Retry-After (of a 429 or 503), and
  text-embeddings-inference's timing headers.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from mhaserve.service.context import REQUEST_ID_HEADER
from mhaserve.service.tei_timing import DESCRIPTIONS as TIMING_HEADERS

METHODS = ("GET", "POST")
EXPOSED = (REQUEST_ID_HEADER, "retry-after", *TIMING_HEADERS)
# How long a browser may keep a preflight's answer: the most Chromium keeps one (2 hours; Firefox 24 hours).
MAX_AGE_S = 7200


def allowing(app: ASGIApp, origins: Sequence[str]) -> ASGIApp:
    """`app` answering calls from pages of `origins` (`*`: any), as the module's docstring says."""
    return CORSMiddleware(
        app,
        allow_origins=origins,
        allow_methods=METHODS,
        allow_headers=["*"],
        expose_headers=EXPOSED,
        max_age=MAX_AGE_S,
    )
