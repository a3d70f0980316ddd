"""Reading and writing JSON bodies the same way on every HTTP route: orjson, then pydantic, with errors each
API's clients can read (a body in the wrong format 415, malformed or invalid 400 naming the field)."""

from __future__ import annotations

import contextlib
import gc
import time
import types
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, Union, get_origin

import orjson
from fastapi import Response
from pydantic import BaseModel, Field, StrictInt, StrictStr, ValidationError
from pydantic.fields import FieldInfo

from mhaserve.runtime.errors import InvalidArgument, ServiceError, UnsupportedMediaType
from mhaserve.service.dataplane import DataPlane
from mhaserve.service.pipeline import EncodeInput

M = TypeVar("M", bound=BaseModel)

# On every list a body may hold: its validation stops at its first bad element. Pydantic otherwise makes an error
# of each (and, in a union, of each for every member it tries): 2 million token ids and one float, 4 MB, made 4
# million errors, 40 s of the event loop (a review's finding). Only the first is said anyway (`validate`).
FAIL_FAST = Field(fail_fast=True)
# A list of token ids, one input of the embedding routes that take ids as well as texts.
TokenIds = Annotated[list[StrictInt], Field(min_length=1), FAIL_FAST]


def documented(**constraints: Any) -> FieldInfo:
    """JSON Schema constraints (`minLength=1`) that the OpenAPI document states and the route checks itself,
    where its own check says more than pydantic's message would ("input 0 is an empty string")."""
    return Field(json_schema_extra=constraints)


Text = Annotated[StrictStr, documented(minLength=1)]
# What the JSON embedding routes (OpenAI's `input`, TEI's `inputs`) take, read by `encode_input`. Token ids come
# before a list of texts: pydantic tries each member, and a list of texts tried first failed once an id, a
# valid list of 2 million ids taking 0.47 s of the event loop (0.04 s this way; a review's finding).
EmbeddingInputs = (
    Text
    | TokenIds
    | Annotated[list[Text], documented(minItems=1), FAIL_FAST]
    | Annotated[list[TokenIds], documented(minItems=1), FAIL_FAST]
)


@dataclass(frozen=True, slots=True)
class Reply:
    """A JSON response body with headers of its own (TEI's timing headers), in place of one `bytes`."""

    body: bytes
    headers: tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class Chunked:
    """A response body sent in chunks as they are written (HTTP/1.1's chunked transfer coding), in place of
    one `bytes`, where the whole would be large to hold at once."""

    media_type: str
    chunks: AsyncIterator[bytes]


def media_type(content_type: str | None) -> str | None:
    """A Content-Type's media type, lowercased, without its parameters (`; charset=utf-8`)."""
    return None if content_type is None else content_type.split(";", 1)[0].strip().lower()


# UTF-8's byte order mark: editors on Windows (Notepad before 2019, PowerShell 5's Out-File -Encoding utf8) begin a
# file with it, and `curl -d @body.json` sends it along. RFC 8259 (8.1) lets a parser ignore it; orjson refuses it.
BOM = b"\xef\xbb\xbf"


JSON_BODY = "JSON with 'Content-Type: application/json'"


def parse_json(body: bytes, content_type: str | None, takes: str = JSON_BODY) -> Any:
    """A JSON body, a byte order mark before it ignored; 415 for a body declared as something else (saying what
    the route `takes`), 400 for one that is not JSON."""
    media = media_type(content_type)
    if media is not None and media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMediaType(f"send the body as {takes}, not {media!r}")
    try:
        return loads(body.removeprefix(BOM))
    except orjson.JSONDecodeError as e:
        raise InvalidArgument(f"the body is not valid JSON: {not_json(body, e)}") from None


def not_json(body: bytes, e: orjson.JSONDecodeError) -> str:
    """Why `body` is not JSON: orjson says "str is not valid UTF-8: surrogates not allowed ... (char 0)" of any
    byte that is no UTF-8, wherever it is; Python's decoder names the byte."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as u:
        return f"the body is not valid UTF-8 (JSON is): at byte {u.start}, {u.reason}"
    return str(e)


# A body this large may hold many arrays: orjson makes each a tracked container, and every 700 of them start a
# collection that walks the young heap (300,000 token-id lists, 3 MB or 8 KB gzipped: 210-270 ms to parse
# on the event loop, 53-58 ms with the collector paused). A parsed body holds no cycles, so none is lost.
PAUSE_COLLECTOR_BYTES = 64 * 1024


def loads(body: bytes) -> Any:
    """orjson's loads, with the collector paused for a large body."""
    if len(body) < PAUSE_COLLECTOR_BYTES:
        return orjson.loads(body)
    enabled = gc.isenabled()
    gc.disable()
    try:
        return orjson.loads(body)
    finally:
        if enabled:
            gc.enable()


def validate(model: type[M], data: Any) -> M:
    """`data` as a `model`, or INVALID_ARGUMENT with one readable message naming the field (OpenAI's `param`)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        first = errors[0]
        loc = [str(part) for part in first["loc"]]
        field = model.model_fields.get(loc[0]) if loc else None
        # One failure per member of a union ("input.str: Input should be a valid string (and 7 more)", for
        # [[]] or [101, 1.0]): say what the field takes instead.
        takes = field.description if field is not None and _is_union(field.annotation) else None
        if takes and len(errors) > 1 and all(str(err["loc"][0]) == loc[0] for err in errors):
            given = data.get(loc[0]) if isinstance(data, dict) else None
            if isinstance(given, list) and given and isinstance(given[0], list) and [] in given:
                raise InvalidArgument(f"input {given.index([])} is an empty list of token ids", param=loc[0]) from None
            raise InvalidArgument(f"{loc[0]}: must be {takes}", param=loc[0]) from None
        where = ".".join(part for part in loc if not part.isdigit() and "[" not in part) or "body"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise InvalidArgument(f"{where}: {first['msg']}{more}", param=loc[0] if loc else None) from None


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response; bytes are sent as they are (already encoded), anything else goes through orjson."""
    body = content if isinstance(content, bytes) else orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def count_first(dataplane: DataPlane, data: Any, field: str) -> None:
    """A list of more inputs (in the body's `field`) than the model takes, refused before pydantic validates
    each (300,000 token-id lists, 3 MB or 8 KB gzipped, took it about half a second)."""
    if isinstance(data, dict):
        count_list(dataplane, data.get(field), data.get("model", ""), field=field)


def count_list(dataplane: DataPlane, inputs: Any, model: Any, *, more: int = 0, field: str = "input") -> None:
    """`count_first` for a list found anywhere in a body, and `more` inputs the request adds to it; its error
    names `field` (the pipeline's name the embeddings API's `input`, not `/decode`'s `ids`)."""
    if isinstance(inputs, list) and inputs and isinstance(inputs[0], (str, list)):
        # A name that is not a string, or a model not served, is refused here too: with no count, 500,000
        # token-id lists naming "nope" held the event loop 1.4-2.7 s for a 404. (Every route's `model` is a
        # StrictStr; this is its validation's message.)
        if not isinstance(model, str):
            raise InvalidArgument("model: Input should be a valid string", param="model")
        pipeline = dataplane.resolve(model)
        try:
            pipeline.count_first(len(inputs) + more)  # (a text, or token ids, is one input)
        except InvalidArgument as e:
            raise InvalidArgument(e.message, param=field) from None


@contextlib.contextmanager
def counted(dataplane: DataPlane, data: Any) -> Iterator[None]:
    """A request refused here, before its pipeline (a field of the wrong type, an empty text), counted as a
    failure of the model version its body names (the default one where it names none), as the pipeline counts
    its own refusals: in KServe's statistics and the model's metrics. Around the checks only, not the
    pipeline's own, which count themselves."""
    started = time.perf_counter_ns()
    try:
        yield
    except InvalidArgument as e:
        model = data.get("model", "") if isinstance(data, dict) else ""
        with contextlib.suppress(ServiceError):  # a model not served: no model's failure
            if isinstance(model, str):
                dataplane.resolve(model).refused(e, started)
        raise


def encode_input(inputs: Any, field: str, **options: Any) -> EncodeInput:
    """The embedding routes' inputs (a text, texts, token ids, or lists of them; validated by their shape),
    as the pipeline's request; an empty list or text is refused naming `field`, as OpenAI's API and TEI do
    (encoder.v1 and KServe embed an empty text)."""
    if isinstance(inputs, str):
        texts: list[str] = [inputs]
    elif inputs and isinstance(inputs[0], str):
        texts = inputs
    elif inputs and isinstance(inputs[0], int):
        return EncodeInput(token_ids=[inputs], **options)
    elif inputs:
        return EncodeInput(token_ids=inputs, **options)
    else:
        raise InvalidArgument(f"{field} is empty: send a text, a list of texts, or token ids", param=field)
    for i, text in enumerate(texts):
        if not text:
            raise InvalidArgument(f"input {i} is an empty string", param=field)
    return EncodeInput(texts=texts, **options)
