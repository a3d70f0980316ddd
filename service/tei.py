"""text-embeddings-inference's embedding API: `POST /embed`, `POST /similarity`, and `POST /` and SageMaker's
`POST /invocations`, where TEI serves an embedding model too.

What TEI's clients send and read, so that they work with this server unchanged: huggingface_hub's
`InferenceClient.feature_extraction` (given the server's URL it posts to `/`; LangChain's
`HuggingFaceEndpointEmbeddings` and Haystack's TEI embedders go through it) and `sentence_similarity` (to `/`
as well), LlamaIndex's `TextEmbeddingsInference` and plain HTTP clients (`/embed`), and SageMaker's
invocations of a TEI container (`/invocations`; its health check, `GET /ping`, is the utility routes').

- `inputs`: a text, a list of texts, a list of token ids, or a list of lists of token ids; the answer is
  a JSON list of vectors, one per input, in order (a list of one for a single text).
- `normalize` (true by default), `truncate` (null: the server's `--auto-truncate`), `prompt_name`,
  `dimensions`: as TEI has them. `truncation_direction` `right` (TEI's default) keeps a long text's start,
  as every API of this server does; `left` is refused with a 400 rather than served as `right`.
- `model`: an extension, as on `/tokenize` (TEI serves one model): a served model's name, or name:version;
  omitted, the default model.
- `/similarity` takes `{"inputs": {"source_sentence", "sentences"}, "parameters": {"truncate",
  "truncation_direction", "prompt_name"}}` and answers the cosine of each sentence's embedding with the
  source's, in order, computed in float64 from the model's vectors. TEI serves it at `/` only when started for
  that task; here `/` and `/invocations` answer it whenever `inputs` is an object (an embedding request's never
  is), so huggingface_hub's `sentence_similarity` needs no second server.
- Errors are TEI's shape, `{"error": "...", "error_type": "..."}` (http/errors.py), with the status of the
  one error map: 400 where TEI answers 413 or 422, as on every other route of this server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import numpy as np
import numpy.typing as npt
import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, RootModel, StrictBool, StrictInt, StrictStr

from mhaserve.runtime.errors import InvalidArgument
from mhaserve.service.dataplane import DataPlane
from mhaserve.service.http.bodies import (
    EmbeddingInputs,
    Text,
    count_first,
    count_list,
    documented,
    encode_input,
    json_response,
    parse_json,
    validate,
)
from mhaserve.service.http.errors import TEI_EMBED_PATH, TEI_PATHS, TEI_ROOT_PATHS, TEI_SIMILARITY_PATH
from mhaserve.service.http.openapi import request_body
from mhaserve.service.pipeline import EncodeInput

# Defined once, with the error map that answers these paths in TEI's shape.
PATHS = TEI_PATHS
EMBED_PATH, ROOT_PATHS, SIMILARITY_PATH = TEI_EMBED_PATH, TEI_ROOT_PATHS, TEI_SIMILARITY_PATH
Direction = Literal["right", "Right", "left", "Left"]


class TextOptions(BaseModel):
    """How TEI's embedding and similarity requests have their texts read."""

    # TEI ignores the fields it does not know (huggingface_hub's client sends encoding_format): so does this.
    model_config = ConfigDict(extra="ignore")

    truncate: StrictBool | None = Field(
        default=None,
        description="cut inputs past the model's maximum instead of refusing them (null: the server's --auto-truncate)",
    )
    truncation_direction: Direction = Field(
        default="right", description="right keeps a long input's start (left is refused: not served here)"
    )
    prompt_name: StrictStr | None = Field(
        default=None, description="a prompt of the model's serving config to put before each text (e.g. query)"
    )


class EmbedRequest(TextOptions):
    """The body of `POST /embed` (and `POST /`)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"inputs": ["a query", "a passage"]}]})

    inputs: EmbeddingInputs = Field(
        description="a text, a list of texts, a list of token ids, or a list of lists of token ids"
    )
    normalize: StrictBool = Field(default=True, description="L2-normalise each embedding")
    dimensions: Annotated[StrictInt, documented(minimum=1)] | None = Field(
        default=None, description="keep the leading dimensions, renormalised"
    )
    model: StrictStr = Field(
        default="", description="a served model's name, or name:version (default: the server's default model)"
    )


class SimilarityInputs(BaseModel):
    source_sentence: Text = Field(description="the text the others are compared with")
    sentences: Annotated[list[Text], documented(minItems=1)] = Field(
        description="the texts to compare with source_sentence"
    )


class SimilarityParameters(TextOptions):
    """The `parameters` of `POST /similarity`."""


class SimilarityRequest(BaseModel):
    """The body of `POST /similarity` (and of `POST /` whose `inputs` is an object)."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={"examples": [{"inputs": {"source_sentence": "a query", "sentences": ["a passage"]}}]},
    )

    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None
    model: StrictStr = Field(
        default="", description="a served model's name, or name:version (default: the server's default model)"
    )


class RootRequest(RootModel[EmbedRequest | SimilarityRequest]):
    """The body of `POST /` and `POST /invocations`: an embedding request, or a similarity one."""


def _served_direction(direction: str) -> None:
    if direction.lower() == "left":
        raise InvalidArgument(
            "truncation_direction left is not served: this server keeps a long input's start, as "
            "sentence-transformers does; send right (the default), or cut the input's start yourself",
            param="truncation_direction",
        )


def from_request(req: EmbedRequest) -> EncodeInput:
    _served_direction(req.truncation_direction)
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
    return await _embed(dataplane, parse_json(body, content_type))


async def similarity(dataplane: DataPlane, body: bytes, content_type: str | None) -> bytes:
    """`POST /similarity`, from the body to the response body."""
    return await _similarity(dataplane, parse_json(body, content_type))


async def root(dataplane: DataPlane, body: bytes, content_type: str | None) -> bytes:
    """`POST /` and `POST /invocations`: a similarity request where `inputs` is an object, else an embedding one."""
    data = parse_json(body, content_type)
    if isinstance(data, dict) and isinstance(data.get("inputs"), dict):
        return await _similarity(dataplane, data)
    return await _embed(dataplane, data)


async def _embed(dataplane: DataPlane, data: Any) -> bytes:
    count_first(dataplane, data, "inputs")
    req = validate(EmbedRequest, data)
    output = await dataplane.encode(from_request(req))
    # orjson writes the float32 rows itself, each value as its shortest exact form
    return orjson.dumps(np.ascontiguousarray(output.embeddings, dtype=np.float32), option=orjson.OPT_SERIALIZE_NUMPY)


async def _similarity(dataplane: DataPlane, data: Any) -> bytes:
    if isinstance(data, dict) and isinstance(data.get("inputs"), dict):  # the source sentence is one more input
        count_list(dataplane, data["inputs"].get("sentences"), data.get("model", ""), more=1)
    req = validate(SimilarityRequest, data)
    inputs, parameters = req.inputs, req.parameters or SimilarityParameters()
    _served_direction(parameters.truncation_direction)
    if not inputs.sentences:
        raise InvalidArgument("inputs.sentences is empty: send the texts to compare with the source", param="inputs")
    texts = [inputs.source_sentence, *inputs.sentences]
    for i, text in enumerate(texts):
        if not text:
            which = "inputs.source_sentence" if i == 0 else f"inputs.sentences {i - 1}"
            raise InvalidArgument(f"{which} is an empty string", param="inputs")
    output = await dataplane.encode(
        EncodeInput(
            texts=texts,
            model=req.model,
            truncate=bool(parameters.truncate),
            normalize=False,
            prompt_name=parameters.prompt_name,
        )
    )
    return orjson.dumps(cosines(output.embeddings), option=orjson.OPT_SERIALIZE_NUMPY)


def cosines(embeddings: npt.NDArray[np.floating[Any]]) -> npt.NDArray[np.float32]:
    """The cosine of each row after the first with the first, in float64 and then rounded to float32 (TEI's
    type); 0 against a vector of zeros, which has no direction."""
    vectors = np.asarray(embeddings, dtype=np.float64)
    norms = np.linalg.norm(vectors, axis=1)
    denominators = norms[1:] * norms[0]
    dots = vectors[1:] @ vectors[0]
    return np.divide(dots, denominators, out=np.zeros_like(dots), where=denominators > 0).astype(np.float32)


def router(dataplane: DataPlane) -> APIRouter:
    api = APIRouter(tags=["text-embeddings-inference"])

    Handler = Callable[[DataPlane, bytes, str | None], Awaitable[bytes]]

    def route(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def answer(request: Request) -> Response:
            return json_response(await handler(dataplane, await request.body(), request.headers.get("content-type")))

        return answer

    either = list[list[float]] | list[float]
    embed_or_similarity = "POST /embed, or /similarity where inputs is an object"
    routes: list[tuple[str, str, str, Handler, type[BaseModel], Any]] = [
        (EMBED_PATH, "embed", "Embed texts or token ids (TEI's API)", embed, EmbedRequest, list[list[float]]),
        (
            SIMILARITY_PATH,
            "similarity",
            "Each sentence's cosine with the source (TEI's API)",
            similarity,
            SimilarityRequest,
            list[float],
        ),
        (
            ROOT_PATHS[0],
            "embed_root",
            f"{embed_or_similarity} (huggingface_hub's client posts here)",
            root,
            RootRequest,
            either,
        ),
        (ROOT_PATHS[1], "invocations", f"{embed_or_similarity} (SageMaker)", root, RootRequest, either),
    ]
    for path, name, summary, handler, body, answers in routes:
        api.add_api_route(
            path,
            route(handler),
            methods=["POST"],
            summary=summary,
            response_model=answers,
            openapi_extra=request_body(body),
            name=name,
            operation_id=name,
        )
    return api
