"""The OpenAPI document at /openapi.json, made to say what the server answers.

FastAPI's own document is not that here, in four ways this module mends:

- The model routes parse their own bodies (orjson, then pydantic) so that a malformed one gets the error
  each API's clients expect and a KServe request may carry binary tensors after its JSON. FastAPI then
  knows nothing of the body: `request_body` describes it in the route's OpenAPI operation and remembers
  the model, whose schema (and those it uses) `complete` puts into the document's components.
- FastAPI documents a 422 "Validation Error" for every route with a parameter. None is answered: the
  parameters are strings and the bodies are read by the routes, so bad input is a 400 from the one error
  map (service/errors.py). `complete` documents that map instead: every operation's `default` response is
  an error in its API's shape, OpenAI's `{"error": {...}}`, the Open Inference Protocol's
  `{"error": "..."}` under /v2, or text-embeddings-inference's `{"error": "...", "error_type": "..."}` on its
  embedding routes (http/errors.py renders each).
- The KServe health routes answer with a status and the protocol's small JSON body (`health_answer`); the
  repository's load and unload with a status and no body (`status_only`).
- With API keys, every route but the open ones (health, and the document itself) needs one: `complete`
  declares the bearer scheme and puts it on those operations (Swagger UI at /docs then asks for the key).

A client generated from the document (openapi-generator, or schemathesis checking the server against it:
tests/service/test_openapi.py) then finds every answer documented.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Response
from pydantic import BaseModel, Field

from mhaserve.service.http.errors import api_of

REF = "#/components/schemas/{model}"
# FastAPI's schemas for the 422 it documents and never answers here.
FASTAPI_VALIDATION = ("HTTPValidationError", "ValidationError")
ERRORS = (
    "An error, with its status: 400 a bad request, 401 a missing or wrong API key, 403 a key without the right, "
    "404 an unknown model, version or route, 405 a method the route does not take, 408 a body too slow to "
    "arrive, 413 a body too large (or a JSON Lines body of too many lines; an input too long is a 400), 415 a body "
    "that is not JSON, 429 the queue full (retry after Retry-After), 500 a bug (the message gives the request id "
    "to find it in the log), 503 loading or draining (retry after Retry-After), 504 no answer within the timeout"
)

SECURITY = "apiKey"
BEARER = {
    "type": "http",
    "scheme": "bearer",
    "description": "an API key (--api-keys-file, MHASERVE_API_KEYS); the repository API needs an admin key",
}
# Every model a route's body is described by, by name (filled as the routers are built).
_bodies: dict[str, type[BaseModel]] = {}


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, rate_limit_error, server_error, ...")
    param: str | None = Field(description="the request's field at fault, where one is")
    code: str = Field(description="model_not_found, or the gRPC status's name in lower case (invalid_argument, ...)")


class OpenAIError(BaseModel):
    """An error as OpenAI's API answers it (the official clients raise their exception classes from it)."""

    error: OpenAIErrorDetail


class KServeError(BaseModel):
    """An error as the Open Inference Protocol's REST API and Triton answer it."""

    error: str


class TEIError(BaseModel):
    """An error as text-embeddings-inference answers it."""

    error: str
    error_type: Literal["Unhealthy", "Backend", "Overloaded", "Validation"] = Field(
        description="Overloaded for a 429, Unhealthy for a 503, Backend for another 5xx, Validation for a 4xx"
    )


ERROR_SHAPES: dict[str, type[BaseModel]] = {"openai": OpenAIError, "kserve": KServeError, "tei": TEIError}


def request_body(model: type[BaseModel], *media_types: str, required: bool = True) -> dict[str, Any]:
    """`openapi_extra` for a route whose body is `model` (JSON unless other media types are named)."""
    _bodies[model.__name__] = model
    schema = {"$ref": REF.format(model=model.__name__)}
    return {
        "requestBody": {
            "required": required,
            "content": {media: {"schema": schema} for media in media_types or ("application/json",)},
        }
    }


def status_only(yes: str, no: str | None = None) -> dict[str, Any]:
    """Decorator arguments for a route that answers with a status and no body: 200 for `yes`, 400 for `no`
    (the Open Inference Protocol's health answers)."""
    responses: dict[int | str, Any] = {200: {"description": yes}}
    if no is not None:
        responses[400] = {"description": no}
    return {"response_class": Response, "responses": responses}


def health_answer(yes: str, no: str | None, **fields: str) -> dict[str, Any]:
    """Decorator arguments for an Open Inference Protocol health route: 200 for `yes`, 400 for `no`, each with
    the protocol's JSON body of `fields` (name: JSON type)."""
    body = {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {name: {"type": kind} for name, kind in fields.items()},
                "required": list(fields),
            }
        }
    }
    responses: dict[int | str, Any] = {200: {"description": yes, "content": body}}
    if no is not None:
        responses[400] = {"description": no, "content": body}
    return {"response_class": Response, "responses": responses}


def complete(app: FastAPI, *, keys: bool = False, open_gets: Sequence[str] = ()) -> None:
    """Generate the document once, as the module docstring says; `keys`: the server asks for API keys on
    every operation but a GET of `open_gets`."""
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = generate()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        models: list[type[BaseModel]] = [*_bodies.values(), *ERROR_SHAPES.values()]
        for model in models:
            schema = model.model_json_schema(ref_template=REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        for path, operations in document.get("paths", {}).items():
            error = ERROR_SHAPES[api_of(path)]
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                responses.setdefault(
                    "default",
                    {
                        "description": ERRORS,
                        "content": {"application/json": {"schema": {"$ref": REF.format(model=error.__name__)}}},
                    },
                )
                if keys and not (method == "get" and path in open_gets):
                    operation["security"] = [{SECURITY: []}]
        if keys:
            document["components"]["securitySchemes"] = {SECURITY: BEARER}
        for name in FASTAPI_VALIDATION:
            if not any(ref == REF.format(model=name) for ref in refs(document)):
                schemas.pop(name, None)
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def refs(node: Any) -> Iterator[str]:
    """Every `$ref` in a document, at any depth."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)
