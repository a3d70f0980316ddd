"""text-embeddings-inference's embedding API: `POST /embed`, `POST /similarity`, and `POST /` and SageMaker's
`POST /invocations`, where TEI serves an embedding model too.

What TEI's clients send and read, so that they work with this server unchanged: huggingface_hub's
`InferenceClient.feature_extraction` (given the server's URL it posts to `/`; Haystack's TEI embedders go
through it) and `sentence_similarity` (to `/` as well), LlamaIndex's `TextEmbeddingsInference`,
langchain-community's `HuggingFaceInferenceAPIEmbeddings` and plain HTTP clients (`/embed`), and SageMaker's
invocations of a TEI container (`/invocations`; its health check, `GET /ping`, is the utility routes').
LangChain's `HuggingFaceEndpointEmbeddings` refuses a URL for its model (langchain-huggingface 1.2.3).

- `inputs`: a text, a list of texts, a list of token ids, or a list of lists of token ids; the answer is
  a JSON list of vectors, one per input, in order (a list of one for a single text).
- `normalize` (true by default), `truncate` (null: the server's `--auto-truncate`), `prompt_name`,
  `dimensions`, `truncation_direction`: as TEI has them (`right`, the default, keeps a long input's start, as
  every API of this server does; `left` its end, a prompt before it cut first, as TEI cuts it).
- `model`: an extension, as on `/tokenize` (TEI serves one model): a served model's name, or name:version;
  omitted, the default model.
- `/similarity` takes `{"inputs": {"source_sentence", "sentences"}, "parameters": {"truncate",
  "truncation_direction", "prompt_name"}}` and answers the cosine of each sentence's embedding with the
  source's, in order, computed in float64 from the model's vectors. TEI serves it at `/` only when started for
  that task; here `/` and `/invocations` answer it whenever `inputs` is an object (an embedding request's never
  is), so huggingface_hub's `sentence_similarity` needs no second server.
- Errors are TEI's shape, `{"error": "...", "error_type": "..."}` (http/errors.py), with the status of the
  one error map: 400 where TEI answers 413 or 422, as on every other route of this server.
- `/invocations` reads a JSON Lines body too (`application/jsonlines`): a SageMaker batch transform's mini-batch
  under BatchStrategy MultiRecord, a request a line, answered a line each, in order, every line by the one
  version of its model that was served as the body was read (`_records`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
import numpy.typing as npt
import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, RootModel, StrictBool, StrictInt, StrictStr

from mhaserve.runtime.errors import InvalidArgument, ServiceError, TooLarge
from mhaserve.service.batching import Embeddings
from mhaserve.service.dataplane import DataPlane
from mhaserve.service.http.bodies import (
    BOM,
    FAIL_FAST,
    JSON_BODY,
    Chunked,
    EmbeddingInputs,
    Reply,
    Text,
    count_first,
    count_list,
    counted,
    documented,
    encode_input,
    json_response,
    media_type,
    not_json,
    parse_json,
    validate,
)
from mhaserve.service.http.errors import TEI_EMBED_PATH, TEI_PATHS, TEI_ROOT_PATHS, TEI_SIMILARITY_PATH
from mhaserve.service.http.openapi import request_body
from mhaserve.service.pipeline import EncodeInput, EncodeOutput, Pipeline
from mhaserve.service.rpc.streaming import ordered
from mhaserve.service.tei_timing import DESCRIPTIONS, characters, timing

# Defined once, with the error map that answers these paths in TEI's shape.
PATHS = TEI_PATHS
EMBED_PATH, ROOT_PATHS, SIMILARITY_PATH = TEI_EMBED_PATH, TEI_ROOT_PATHS, TEI_SIMILARITY_PATH
Direction = Literal["right", "Right", "left", "Left"]
# A JSON Lines body on `/invocations`: a SageMaker batch transform's mini-batch under BatchStrategy MultiRecord
# (its ContentType as the job names it: application/jsonlines is SageMaker's own name).
JSON_LINES = frozenset(
    {"application/jsonlines", "application/jsonl", "application/x-jsonlines", "application/x-ndjson"}
)
JSON_LINES_MEDIA = "application/jsonlines"
INVOCATIONS_BODY = f"{JSON_BODY}, or as JSON Lines ('Content-Type: {JSON_LINES_MEDIA}', a request a line)"
# The most lines in one body: what a 1 MB mini-batch (MaxPayloadInMB's least) of the shortest lines holds, about
# 16 bytes each; their vectors, held until all are computed, about 100 MB at 384 dimensions.
MAX_RECORDS = 65536
YIELD_EVERY = 256  # lines read and validated between turns of the event loop given to other requests
CHUNK_BYTES = 64 * 1024  # the answer is written and sent in pieces of about this size


class TextOptions(BaseModel):
    """How TEI's embedding and similarity requests have their texts read."""

    # TEI ignores the fields it does not know (huggingface_hub's client sends encoding_format): so does this.
    model_config = ConfigDict(extra="ignore")

    truncate: StrictBool | None = Field(
        default=None,
        description="cut inputs past the model's maximum instead of refusing them (null: the server's --auto-truncate)",
    )
    truncation_direction: Direction = Field(
        default="right",
        description="which end of a long input is cut: right keeps its start, left its end (and cuts a prompt first)",
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
        default=None, description="keep the leading dimensions, renormalised (as they are with normalize false)"
    )
    model: StrictStr = Field(
        default="", description="a served model's name, or name:version (default: the server's default model)"
    )


class SimilarityInputs(BaseModel):
    source_sentence: Text = Field(description="the text the others are compared with")
    sentences: Annotated[list[Text], documented(minItems=1), FAIL_FAST] = Field(
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


def cuts_start(direction: str) -> bool:
    """Whether TEI's truncation_direction cuts a long input's start (left) rather than its end (right)."""
    return direction.lower() == "left"


def from_request(req: EmbedRequest) -> EncodeInput:
    return encode_input(
        req.inputs,
        "inputs",
        model=req.model,
        truncate=req.truncate,
        normalize=req.normalize,
        dimensions=req.dimensions,
        prompt_name=req.prompt_name,
        truncate_start=cuts_start(req.truncation_direction),
    )


async def embed(dataplane: DataPlane, body: bytes, content_type: str | None) -> Reply:
    """`POST /embed` from the body to the response body and its timing headers: the documented route and the
    middleware's fast route both run this."""
    started = time.perf_counter_ns()
    return await _answer(dataplane, _embed_call(dataplane, parse_json(body, content_type)), started)


async def similarity(dataplane: DataPlane, body: bytes, content_type: str | None) -> Reply:
    """`POST /similarity`, from the body to the response body and its timing headers."""
    started = time.perf_counter_ns()
    return await _answer(dataplane, _similarity_call(dataplane, parse_json(body, content_type)), started)


async def root(dataplane: DataPlane, body: bytes, content_type: str | None, takes: str = JSON_BODY) -> Reply:
    """`POST /`: a similarity request where `inputs` is an object, else an embedding one."""
    started = time.perf_counter_ns()
    return await _answer(dataplane, _call(dataplane, parse_json(body, content_type, takes)), started)


async def invocations(dataplane: DataPlane, body: bytes, content_type: str | None) -> Reply | Chunked:
    """`POST /invocations`: as `POST /`, or, for a JSON Lines body, each line as one such request and the
    answers a line each (SageMaker's batch transform with BatchStrategy MultiRecord)."""
    if media_type(content_type) in JSON_LINES:
        return await _records(dataplane, body)
    return await root(dataplane, body, content_type, INVOCATIONS_BODY)


@dataclass(frozen=True)
class _Call:
    """A validated request of these routes: what to encode, and how its answer is written from the vectors."""

    input: EncodeInput
    answer: Callable[[Embeddings], bytes]
    # The pipeline's error in the request's terms (an input of the list it embeds named by the request's field).
    named: Callable[[ServiceError], ServiceError] = lambda error: error

    def resolve(self, dataplane: DataPlane) -> Pipeline:
        """The model version the request names (its model's latest served one, where it names none)."""
        try:
            return dataplane.resolve(self.input.model, self.input.version)
        except ServiceError as e:
            raise self.named(e) from None

    async def encode(self, pipeline: Pipeline) -> EncodeOutput:
        try:
            return await pipeline.encode(self.input)
        except ServiceError as e:
            raise self.named(e) from None


def _call(dataplane: DataPlane, data: Any) -> _Call:
    if isinstance(data, dict) and isinstance(data.get("inputs"), dict):
        return _similarity_call(dataplane, data)
    return _embed_call(dataplane, data)


async def _answer(dataplane: DataPlane, call: _Call, started_ns: int) -> Reply:
    output = await call.encode(call.resolve(dataplane))
    fields = timing(characters(call.input), output, time.perf_counter_ns() - started_ns)
    return Reply(call.answer(output.embeddings), tuple((k.encode(), v.encode()) for k, v in fields))


def _embed_call(dataplane: DataPlane, data: Any) -> _Call:
    count_first(dataplane, data, "inputs")
    with counted(dataplane, data):
        return _Call(from_request(validate(EmbedRequest, data)), _vectors)


def _vectors(embeddings: Embeddings) -> bytes:
    # orjson writes the float32 rows itself, each value as its shortest exact form
    return orjson.dumps(np.ascontiguousarray(embeddings, dtype=np.float32), option=orjson.OPT_SERIALIZE_NUMPY)


def _similarity_call(dataplane: DataPlane, data: Any) -> _Call:
    if isinstance(data, dict) and isinstance(data.get("inputs"), dict):  # the source sentence is one more input
        count_list(dataplane, data["inputs"].get("sentences"), data.get("model", ""), more=1)
    with counted(dataplane, data):
        return _similarity_checked(data)


def _similarity_checked(data: Any) -> _Call:
    req = validate(SimilarityRequest, data)
    inputs, parameters = req.inputs, req.parameters or SimilarityParameters()
    if not inputs.sentences:
        raise InvalidArgument("inputs.sentences is empty: send the texts to compare with the source", param="inputs")
    texts = [inputs.source_sentence, *inputs.sentences]
    for i, text in enumerate(texts):
        if not text:
            which = "inputs.source_sentence" if i == 0 else f"inputs.sentences {i - 1}"
            raise InvalidArgument(f"{which} is an empty string", param="inputs")
    asked = EncodeInput(
        texts=texts,
        model=req.model,
        truncate=parameters.truncate,
        normalize=False,
        prompt_name=parameters.prompt_name,
        truncate_start=cuts_start(parameters.truncation_direction),
    )
    return _Call(
        asked,
        lambda embeddings: orjson.dumps(cosines(embeddings), option=orjson.OPT_SERIALIZE_NUMPY),
        _similarity_named,
    )


def _similarity_named(error: ServiceError) -> ServiceError:
    """The pipeline's "input 2 is ... tokens long ...; set truncate" as the request says it: the source sentence
    is the first input it embeds, and truncate is one of the parameters. A new error: a batch's is shared."""
    found = re.match(r"input (\d+) ", error.message)
    if not isinstance(error, InvalidArgument) or found is None:
        return error
    index = int(found[1])
    which = "inputs.source_sentence" if index == 0 else f"inputs.sentences {index - 1}"
    message = which + error.message[found.end() - 1 :]
    return InvalidArgument(message.replace("set truncate", "set parameters.truncate"), param=error.param)


async def _records(dataplane: DataPlane, body: bytes) -> Chunked:
    """A JSON Lines body's answer: every line read and validated before any is computed, so that a bad line
    is a 400 naming it with nothing computed, and every line computed before the answer starts, so that any
    failure is the answer's status (SageMaker retries or fails the mini-batch by it) and never an answer cut
    short. Up to `streaming.WINDOW` lines are computed at once, batching together and with other clients'
    requests, and no more than hold half the queue (`streaming.ordered`); the vectors are held, not their
    JSON, which is written out in chunks as it is sent.

    The body is answered by one version of each model its lines name: the one served when its first line
    naming it was read, held until the last line is answered (`Pipeline.held`). Resolved a line at a time as
    each was computed, a version published meanwhile answered the lines after it, two embedding spaces (or
    two widths) in one answer with nothing saying which; and a version retired meanwhile, resolved once but
    not held, could close between two lines and refuse the rest."""
    # A byte order mark before the first line (Windows' editors write one; orjson refuses it), and blank lines
    # after the last (the newline that ends it, a file ending in two) are no requests. A blank line between
    # two is refused: skipped, the answers' lines would no longer match the body's, which is how they are joined.
    # (rstrip, not a loop over the lines: a body of a million newlines took a second of the event loop.)
    lines = body.removeprefix(BOM).rstrip().split(b"\n")
    if lines == [b""]:
        lines = []
    if not lines:
        raise InvalidArgument("the JSON Lines body has no lines: send one request body a line", param="inputs")
    if len(lines) > MAX_RECORDS:
        raise TooLarge(
            f"{len(lines)} lines in one JSON Lines body; the most in one is {MAX_RECORDS}: lower the batch "
            "transform's MaxPayloadInMB"
        )
    with contextlib.ExitStack() as holding:
        # Held as soon as it is resolved: a version retired while a long body is read, in turns with other
        # requests, would close before any of its lines is computed, and refuse them all.
        pipelines: dict[tuple[str, int | str | None], Pipeline] = {}
        calls: list[tuple[int, _Call, Pipeline]] = []
        for number, line in enumerate(lines, 1):
            try:
                if not line.strip():
                    raise InvalidArgument("it is empty: each line is one request's JSON body", param="inputs")
                try:
                    data = orjson.loads(line)
                except orjson.JSONDecodeError as e:
                    raise InvalidArgument(f"it is not valid JSON: {not_json(line, e)}") from None
                call = _call(dataplane, data)
                # The default model by its name: lines that leave it out and lines that name it, read on both
                # sides of a turn given to other requests (a version switched in meanwhile), share one version.
                asked = (call.input.model or dataplane.default_model, call.input.version)
                if (pipeline := pipelines.get(asked)) is None:
                    pipeline = pipelines[asked] = call.resolve(dataplane)
                    holding.enter_context(pipeline.held())
                calls.append((number, call, pipeline))
            except ServiceError as e:
                raise on_line(e, number) from None
            if number % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a long body is read in turns with the other requests on the event loop

        async def each() -> AsyncIterator[tuple[int, _Call, Pipeline]]:
            for item in calls:
                yield item

        async def compute(item: tuple[int, _Call, Pipeline]) -> tuple[_Call, Embeddings]:
            number, call, pipeline = item
            try:
                return call, (await call.encode(pipeline)).embeddings
            except ServiceError as e:
                raise on_line(e, number) from None

        def share(item: tuple[int, _Call, Pipeline]) -> float:
            _, call, pipeline = item
            return pipeline.queue_share(len(call.input.texts) or len(call.input.token_ids))

        answers: list[tuple[_Call, Embeddings] | None] = [a async for a in ordered(each(), compute, _end, share=share)]
    return Chunked(JSON_LINES_MEDIA, _written(answers))


def on_line(error: ServiceError, number: int) -> ServiceError:
    """The error, of the same kind, its message saying which line of the body it concerns. A new one: a batch's
    failure is one object raised to every request that had an input in it, other clients' among them."""
    return type(error)(f"line {number}: {error.message}", param=error.param)


def _end(item: Any, error: ServiceError) -> Any:
    """A line that fails fails the whole body (its answer must hold every line's, in order)."""
    raise error


async def _written(answers: list[tuple[_Call, Embeddings] | None]) -> AsyncIterator[bytes]:
    """The answers, a line each, without a newline after the last (SageMaker's AssembleWith Line adds one
    after each mini-batch's answer), in chunks, each sent before the next is written."""
    chunk = bytearray()
    for i, answer in enumerate(answers):
        assert answer is not None
        answers[i] = None  # written: its vectors may go
        call, embeddings = answer
        if i:
            chunk += b"\n"
        chunk += call.answer(embeddings)
        if len(chunk) >= CHUNK_BYTES:
            yield bytes(chunk)
            chunk.clear()
            await asyncio.sleep(0)
    if chunk:
        yield bytes(chunk)


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

    Handler = Callable[[DataPlane, bytes, str | None], Awaitable[Reply | Chunked]]

    def route(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def answer(request: Request) -> Response:
            out = await handler(dataplane, await request.body(), request.headers.get("content-type"))
            if isinstance(out, Chunked):
                return StreamingResponse(out.chunks, media_type=out.media_type)
            return json_response(out.body, headers={k.decode(): v.decode() for k, v in out.headers})

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
        (
            ROOT_PATHS[1],
            "invocations",
            f"{embed_or_similarity} (SageMaker; a JSON Lines body, application/jsonlines, a request a line)",
            invocations,
            RootRequest,
            either,
        ),
    ]
    digits = {"type": "string", "pattern": "^[0-9]+$"}
    timed = {"headers": {name: {"description": text, "schema": digits} for name, text in DESCRIPTIONS.items()}}
    # /invocations' JSON Lines, both ways: a schema cannot say what each line holds, so its description does.
    lines: dict[str, Any] = {
        "schema": {
            "type": "string",
            "description": "JSON Lines: a request a line, each what the application/json body is (a request's "
            "answer a line, in order, each what the application/json answer is)",
        }
    }
    for path, name, summary, handler, body, answers in routes:
        extra = request_body(body)
        responses: dict[int | str, dict[str, Any]] = {200: timed}
        if handler is invocations:
            extra["requestBody"]["content"][JSON_LINES_MEDIA] = lines
            responses = {200: timed | {"content": {JSON_LINES_MEDIA: lines}}}
        api.add_api_route(
            path,
            route(handler),
            methods=["POST"],
            summary=summary,
            response_model=answers,
            responses=responses,
            openapi_extra=extra,
            name=name,
            operation_id=name,
        )
    return api
