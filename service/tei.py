"""text-embeddings-inference's embedding API: `POST /embed`, and `POST /`, where TEI serves it too.

What TEI's clients send and read, so that they work with this server unchanged: huggingface_hub's
`InferenceClient.feature_extraction` (given the server's URL it posts to `/`; LangChain's
`HuggingFaceEndpointEmbeddings` and Haystack's TEI embedders go through it), LlamaIndex's
`TextEmbeddingsInference` and plain HTTP clients (`/embed`).

- `inputs`: a text, a list of texts, a list of token ids, or a list of lists of token ids; the answer is
  a JSON list of vectors, one per input, in order (a list of one for a single text).
- `normalize` (true by default), `truncate` (null: the server's `--auto-truncate`), `prompt_name`,
  `dimensions`: as TEI has them. `truncation_direction` `right` (TEI's default) keeps a long text's start,
  as every API of this server does; `left` is refused with a 400 rather than served as `right`.
- `model`: an extension, as on `/tokenize` (TEI serves one model): a served model's name, or name:version;
  omitted, the default model.
- Errors are TEI's shape, `{"error": "...", "error_type": "..."}` (http/errors.py), with the status of the
  one error map: 400 where TEI answers 413 or 422, as on every other route of this server.
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from mhaserve.runtime.errors import InvalidArgument
from mhaserve.service.dataplane import DataPlane
from mhaserve.service.http.bodies import (
    EmbeddingInputs,
    count_first,
    documented,
    encode_input,
    json_response,
    parse_json,
    validate,
)
from mhaserve.service.http.errors import TEI_PATHS
from mhaserve.service.http.openapi import request_body
from mhaserve.service.pipeline import EncodeInput

# /embed, and /, where TEI answers an embedding model's POST as /embed (huggingface_hub's client posts there):
# defined once, with the error map that answers these paths in TEI's shape.
PATHS = TEI_PATHS
EMBED_PATH, ROOT_PATH = PATHS


class EmbedRequest(BaseModel):
    """The body of `POST /embed` (and `POST /`)."""

    # TEI ignores the fields it does not know (huggingface_hub's client sends encoding_format): so does this.
    model_config = ConfigDict(extra="ignore", json_schema_extra={"examples": [{"inputs": ["a query", "a passage"]}]})

    inputs: EmbeddingInputs = Field(
        description="a text, a list of texts, a list of token ids, or a list of lists of token ids"
    )
    normalize: StrictBool = Field(default=True, description="L2-normalise each embedding")
    truncate: StrictBool | None = Field(
        default=None,
        description="cut inputs past the model's maximum instead of refusing them (null: the server's --auto-truncate)",
    )
    truncation_direction: Literal["right", "Right", "left", "Left"] = Field(
        default="right", description="right keeps a long input's start (left is refused: not served here)"
    )
    prompt_name: StrictStr | None = Field(
        default=None, description="a prompt of the model's serving config to put before each text (e.g. query)"
    )
    dimensions: Annotated[StrictInt, documented(minimum=1)] | None = Field(
        default=None, description="keep the leading dimensions, renormalised"
    )
    model: StrictStr = Field(
        default="", description="a served model's name, or name:version (default: the server's default model)"
    )


def from_request(req: EmbedRequest) -> EncodeInput:
    if req.truncation_direction.lower() == "left":
        raise InvalidArgument(
            "truncation_direction left is not served: this server keeps a long input's start, as "
            "sentence-transformers does; send right (the default), or cut the input's start yourself",
            param="truncation_direction",
        )
    return encode_input(
        req.inputs,
        "inputs",
        model=req.model,
        truncate=bool(req.truncate),
        normalize=req.normalize,
        dimensions=req.dimensions,
        prompt_name=req.prompt_name,
    )


async def embed(dataplane: DataPlane, body: bytes, content_type: str | None) -> bytes:
    """`POST /embed` from the body to the response body: the documented route and the middleware's fast
    route both run this."""
    data = parse_json(body, content_type)
    count_first(dataplane, data, "inputs")
    req = validate(EmbedRequest, data)
    output = await dataplane.encode(from_request(req))
    # orjson writes the float32 rows itself, each value as its shortest exact form
    return orjson.dumps(np.ascontiguousarray(output.embeddings, dtype=np.float32), option=orjson.OPT_SERIALIZE_NUMPY)


def router(dataplane: DataPlane) -> APIRouter:
    api = APIRouter(tags=["text-embeddings-inference"])

    async def route(request: Request) -> Response:
        return json_response(await embed(dataplane, await request.body(), request.headers.get("content-type")))

    for path, name, summary in (
        (EMBED_PATH, "embed", "Embed texts or token ids (text-embeddings-inference's API)"),
        (ROOT_PATH, "embed_root", "POST /embed, where text-embeddings-inference serves it too (huggingface_hub)"),
    ):
        api.add_api_route(
            path,
            route,
            methods=["POST"],
            summary=summary,
            response_model=list[list[float]],
            openapi_extra=request_body(EmbedRequest),
            name=name,
            operation_id=name,
        )
    return api
