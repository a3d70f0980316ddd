"""The OpenAPI document's request bodies for routes that read their body themselves.

The model routes parse their own bodies (orjson, then pydantic) so that a malformed one gets the error
each API's clients expect and a KServe request may carry binary tensors after its JSON. FastAPI then
knows nothing of the body: `request_body` describes it in the route's OpenAPI operation, and
`add_schemas` puts the models it names into the document's components.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel], *media_types: str) -> dict[str, Any]:
    """`openapi_extra` for a route whose body is `model` (JSON unless other media types are named)."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {
        "requestBody": {
            "required": True,
            "content": {media: {"schema": schema} for media in media_types or ("application/json",)},
        }
    }


def add_schemas(app: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Generate the document once, with the models' schemas (and those they use) in its components."""
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = generate()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            schema = model.model_json_schema(ref_template=REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]
