"""HTTP error responses: the error map's status, in the body shape each API's clients read.

The status comes from `mhaserve.service.errors.to_http`, the one map every protocol shares. The body
follows the API of the route: OpenAI's `{"error": {"message", "type", "param", "code"}}` (which the
official clients turn into their exception classes) everywhere but the Open Inference Protocol's
routes, which answer `{"error": "<message>"}` as its REST specification and Triton do, and
text-embeddings-inference's embedding routes, which answer `{"error": "<message>", "error_type": "..."}`
as TEI does.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import orjson

from mhaserve.runtime.errors import NotFound, ServiceError
from mhaserve.service.errors import grpc_code, to_http

KSERVE_PREFIX = "/v2"
# text-embeddings-inference's routes, as service/tei.py serves them: `/embed`; `/`, and SageMaker's
# `/invocations`, where TEI serves an embedding model too; `/similarity`
TEI_EMBED_PATH, TEI_ROOT_PATHS, TEI_SIMILARITY_PATH = "/embed", ("/", "/invocations"), "/similarity"
TEI_PATHS = (TEI_EMBED_PATH, *TEI_ROOT_PATHS, TEI_SIMILARITY_PATH)
# TEI's routes for models of other kinds than an embedding model, which this server does not serve: a request
# to one is told so, in TEI's error shape (app.py), where it read "no route".
TEI_UNSERVED = {
    "/rerank": "for a reranker",
    "/predict": "for a classifier",
    "/embed_sparse": "for a sparse embedding model (SPLADE)",
    "/embed_all": "with each token's embedding",
}
# Clients may retry these: the queue was full, or the server is loading or draining.
RETRY_AFTER_SECONDS = 1
CODE_KEY = "mhaserve.code"  # the scope key where the status name in gRPC's vocabulary is left for the metrics


def api_of(path: str) -> str:
    """Whose error shape a path answers in: "kserve", "tei" or "openai"."""
    if path == KSERVE_PREFIX or path.startswith(KSERVE_PREFIX + "/"):
        return "kserve"
    plain = path.rstrip("/") or path  # a TEI route's with a trailing slash (a 404) in TEI's shape too
    return "tei" if plain in TEI_PATHS or plain in TEI_UNSERVED else "openai"


def tei_error_type(status: int) -> str:
    """TEI's `error_type` for a status, among the names TEI itself answers with."""
    if status == 429:
        return "Overloaded"
    if status == 503:
        return "Unhealthy"
    return "Backend" if status >= 500 else "Validation"


def error_body(path: str, status: int, kind: str, message: str, param: str | None, code: str) -> bytes:
    api = api_of(path)
    if api == "kserve":
        return orjson.dumps({"error": message})
    if api == "tei":
        return orjson.dumps({"error": message, "error_type": tei_error_type(status)})
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def render(
    error: BaseException, path: str, request_id: str, scope: MutableMapping[str, Any] | None = None
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """(status, headers, body) for an error raised while handling `path`. Anything that is not a
    ServiceError is a bug: 500, and a message that points to the log by the request id."""
    http, message = to_http(error, request_id)
    code = grpc_code(error).name
    param = error.param if isinstance(error, ServiceError) else None
    if scope is not None:
        scope[CODE_KEY] = code
    headers = [(b"content-type", b"application/json")]
    # OpenAI's API names an unknown model `model_not_found`; the other codes are gRPC's names.
    body_code = "model_not_found" if isinstance(error, NotFound) and param == "model" else code.lower()
    if http.status in (429, 503):
        headers.append((b"retry-after", str(RETRY_AFTER_SECONDS).encode()))
    if http.status == 401:  # RFC 9110 11.6.1: a 401 says which scheme it takes (the API keys are bearer tokens)
        headers.append((b"www-authenticate", b'Bearer realm="mhaserve"'))
    return http.status, headers, error_body(path, http.status, http.type, message, param, body_code)
