"""OpenAI's embeddings API (`POST /v1/embeddings`, `GET /v1/models`; also without `/v1`): JSON in and out at
the edge, the data plane in between.

What the official clients send and read: `input` as a string, a list of strings, a list of token ids
or a list of lists of token ids; `model`; `encoding_format` `float` or `base64` (little-endian float32,
what the Python client asks for by default and decodes); `dimensions` (the leading dimensions,
renormalised: Matryoshka; as they are with the `normalize` false extension); `user`, accepted and ignored.
Vectors are L2-normalised, as OpenAI's are.
`truncate` (an extension, as in TEI) cuts inputs longer than the model's maximum instead of refusing
them, or refuses them with false; missing or null, the server's `--auto-truncate` decides. Errors are
OpenAI's shape with the status the clients map to their exception classes (http/errors.py).
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from mhaserve.service.dataplane import DataPlane
from mhaserve.service.http.bodies import (
    EmbeddingInputs,
    count_first,
    counted,
    documented,
    encode_input,
    json_response,
    parse_json,
    validate,
)
from mhaserve.service.http.openapi import request_body
from mhaserve.service.pipeline import EncodeInput, EncodeOutput

PREFIX = "/v1"
EMBEDDINGS_PATH = f"{PREFIX}/embeddings"
# and without the prefix, for a client whose base URL leaves /v1 out, as one set up for Infinity (which serves
# the API there) or TEI (which answers /embeddings too) does; /models likewise
EMBEDDINGS_PATHS = (EMBEDDINGS_PATH, "/embeddings")
OWNER = "mhaserve"


class EmbeddingRequest(BaseModel):
    """The body of `POST /v1/embeddings`."""

    # Clients add fields of their own; OpenAI ignores them too.
    model_config = ConfigDict(extra="ignore", json_schema_extra={"examples": [{"input": ["a query", "a passage"]}]})

    input: EmbeddingInputs = Field(
        description="a text, a list of texts, a list of token ids, or a list of lists of token ids"
    )
    model: StrictStr = Field(
        default="", description="a served model's name, or name:version (default: the server's default model)"
    )
    # null is the default, as for every optional field: a client may write unset fields as null (the openai
    # client sends encoding_format=None as such)
    encoding_format: Literal["float", "base64"] | None = Field(default="float", description="null: float")
    dimensions: Annotated[StrictInt, documented(minimum=1)] | None = Field(
        default=None, description="keep the leading dimensions, renormalised (as they are with normalize false)"
    )
    user: StrictStr | None = Field(default=None, description="accepted and ignored")
    truncate: StrictBool | None = Field(
        default=None,
        description="cut inputs past the model's maximum instead of refusing them (null: the server's --auto-truncate)",
    )
    prompt_name: StrictStr | None = Field(
        default=None, description="a prompt of the model's serving config to put before each text (e.g. query)"
    )
    # OpenAI's embeddings are unit length, whatever the model's manifest says; TEI's and encoder.v1's clients
    # turn it off with this (it was ignored as an unknown field: such a client got normalised vectors, unwarned).
    normalize: StrictBool | None = Field(
        default=True,
        description="L2-normalise each embedding, as OpenAI's are (null: true); false: the model's pooled vector",
    )


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32")


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = OWNER


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


def from_request(req: EmbeddingRequest) -> EncodeInput:
    return encode_input(
        req.input,
        "input",
        model=req.model,
        truncate=req.truncate,
        normalize=req.normalize is not False,
        dimensions=req.dimensions,
        prompt_name=req.prompt_name,
    )


def model_id(asked: str, name: str, version: int) -> str:
    """The model a response names, as `/v1/models` lists it: `name` for a model asked for by name (its latest
    version), `name:version` for one asked for at a version (`name:01` is listed, and answered, as `name:1`)."""
    return f"{name}:{version}" if ":" in asked else name


def to_response(output: EncodeOutput, encoding_format: str, model: str) -> bytes:
    """The response body, encoded once (orjson writes numpy rows without a Python float per value)."""
    rows = np.ascontiguousarray(output.embeddings, dtype="<f4")
    if encoding_format == "base64":
        vectors: list[Any] = [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
    else:
        vectors = list(rows)  # orjson writes float32 arrays itself, each value as its shortest exact form
    return orjson.dumps(
        {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "model": model,
            "usage": {"prompt_tokens": output.input_tokens, "total_tokens": output.input_tokens},
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


async def embed(dataplane: DataPlane, body: bytes, content_type: str | None) -> bytes:
    """`POST /v1/embeddings` from the body to the response body: the FastAPI route (which documents the API)
    and the middleware's fast route (which serves it) both run this."""
    data = parse_json(body, content_type)
    count_first(dataplane, data, "input")
    with counted(dataplane, data):
        req = validate(EmbeddingRequest, data)
        asked = from_request(req)
    output = await dataplane.encode(asked)
    return to_response(output, req.encoding_format or "float", model_id(req.model, output.model, output.version))


def router(dataplane: DataPlane) -> APIRouter:
    """The OpenAI-compatible routes over the data plane."""
    api = APIRouter(tags=["OpenAI"])

    async def embeddings(request: Request) -> Response:
        return json_response(await embed(dataplane, await request.body(), request.headers.get("content-type")))

    summaries = ("Embed texts or token ids (OpenAI embeddings API)", "POST /v1/embeddings, for a base URL without /v1")
    for path, name, summary in zip(EMBEDDINGS_PATHS, ("embeddings", "embeddings_unprefixed"), summaries, strict=True):
        api.add_api_route(
            path,
            embeddings,
            methods=["POST"],
            summary=summary,
            response_model=EmbeddingResponse,
            openapi_extra=request_body(EmbeddingRequest),
            name=name,
        )

    def listing(name: str) -> Model:
        pipeline = dataplane.resolve(name)
        return Model(id=model_id(name, pipeline.model.name, pipeline.model.version), created=pipeline.created)

    async def models() -> Response:
        ids = [
            i
            for name in [dataplane.default_model, *(n for n in dataplane.model_names() if n != dataplane.default_model)]
            if dataplane.versions(name)
            for i in [name, *(f"{name}:{v}" for v in dataplane.versions(name))]
        ]
        return json_response(ModelList(data=[listing(i) for i in ids]).model_dump())

    async def model(model: str) -> Response:
        return json_response(listing(model).model_dump())

    for prefix, suffix in ((PREFIX, ""), ("", " (for a base URL without /v1)")):
        api.add_api_route(
            f"{prefix}/models",
            models,
            methods=["GET"],
            summary="The models served (OpenAI's list shape): each by its name (its latest version) and as "
            "name:version" + suffix,
            response_model=ModelList,
            name="models" + ("_unprefixed" if suffix else ""),
        )
        api.add_api_route(
            prefix + "/models/{model}",
            model,
            methods=["GET"],
            summary="One served model (name, or name:version)" + suffix,
            response_model=Model,
            name="model" + ("_unprefixed" if suffix else ""),
        )

    return api
