"""The Open Inference Protocol over HTTP (KServe v2 REST, with Triton's extensions and binary tensor data).

The same model as the gRPC servicer (tensors.py): `text` BYTES, or `input_ids` and `attention_mask`
INT64, in; `embeddings` FP32 out. Tensors come as JSON `data` or, with Triton's binary tensor data
extension (what `tritonclient.http` sends by default), as raw bytes after the JSON: the request's
`Inference-Header-Content-Length` header gives the JSON's length, and each binary input says its size in
`parameters.binary_data_size`. The output goes back as binary data when the request asks for it
(`binary_data_output`, or `binary_data` on the output, as tritonclient does), else as JSON.

Readiness routes answer 200 for true and 400 for false, as the specification and Triton do, with the
specification's small JSON body (`{"ready": true}`), which KServe's own REST client reads.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request, Response
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from mhaserve.runtime.errors import InvalidArgument, ServiceError
from mhaserve.runtime.manifest import number
from mhaserve.service.dataplane import DataPlane
from mhaserve.service.http.bodies import (
    BOM,
    FAIL_FAST,
    documented,
    json_response,
    loads,
    not_json,
    parse_json,
    validate,
)
from mhaserve.service.http.openapi import health_answer, request_body, status_only
from mhaserve.service.kserve.model import (
    EXTENSIONS,
    config,
    metadata,
    model_is_ready,
    statistics,
    statistics_of,
)
from mhaserve.service.kserve.tensors import (
    INPUT_TYPES,
    OUTPUT,
    PARAMETER_TYPES,
    ParamT,
    Tensor,
    check_count,
    check_input,
    check_outputs,
    declared_inputs,
    encode_input,
    outside_int64,
    request_options,
)
from mhaserve.service.models import ModelManager
from mhaserve.service.pipeline import EncodeInput, EncodeOutput
from mhaserve.service.version import SERVER_NAME, server_version

PREFIX = "/v2"
HEADER_LENGTH = "inference-header-content-length"
BINARY_SIZE = "binary_data_size"
# What an input's `data` must hold, by its datatype: the JSON type and its name in the error.
JSON_TYPES: dict[str, tuple[type, str]] = {"BYTES": (str, "strings"), "INT64": (int, "integers")}
# The routes that answer while the model loads and while the server drains (with false), as the gRPC ones.
HEALTH_PATHS = (f"{PREFIX}/health/live", f"{PREFIX}/health/ready")


class Body(BaseModel):
    """A part of a request body: unknown fields ignored, and an optional field written as null unset, as a null
    parameter is (MLServer's clients write unset fields so; they were refused "Input should be a valid
    string"). A required field null is then missing, and refused naming it."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @classmethod
    def __get_pydantic_json_schema__(cls, core: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """The schema says so: each optional field may be null."""
        schema = handler.resolve_ref_schema(handler(core))
        required = set(schema.get("required", ()))
        for name, field in schema.get("properties", {}).items():
            if name in required:
                continue
            kept = {k: field.pop(k) for k in ("title", "description", "default", "examples") if k in field}
            options = field.pop("anyOf", None) or [dict(field)]
            field.clear()
            field.update(kept, anyOf=[*options, {"type": "null"}])
        return schema


class InputTensor(Body):
    name: Annotated[StrictStr, documented(enum=list(INPUT_TYPES))]
    shape: Annotated[list[StrictInt], FAIL_FAST]  # ["1"] or [1.0] is refused, as Triton's JSON parser does
    datatype: Annotated[StrictStr, documented(enum=sorted(set(INPUT_TYPES.values())))]
    parameters: dict[str, Any] = Field(default_factory=dict)
    data: Any = Field(default=None, description="the values, row-major (nested or flat); absent for binary data")


class OutputTensor(Body):
    name: Annotated[StrictStr, documented(enum=[OUTPUT])]
    parameters: dict[str, Any] = Field(default_factory=dict)


class InferenceRequest(Body):
    """The JSON part of `POST /v2/models/{name}[/versions/{version}]/infer`."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["a query", "a passage"]}]}
            ]
        },
    )

    id: StrictStr = ""
    parameters: dict[str, Any] = Field(
        default_factory=dict,
        description="normalize and truncate (bools), prompt_name (a string) and dimensions (an integer), as in "
        "encoder.v1's Encode; binary_data_output (a bool: every output as binary data); others are ignored",
    )
    inputs: Annotated[list[InputTensor], documented(minItems=1), FAIL_FAST]
    outputs: Annotated[list[OutputTensor], FAIL_FAST] = Field(default_factory=list)


def _split(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """(the JSON, the binary data after it)."""
    if header_length is None:
        return body, memoryview(b"")
    n = number(header_length)
    if n is None:
        raise InvalidArgument(
            f"Inference-Header-Content-Length is {header_length!r}: not a byte count (the length of the JSON "
            "before the binary data, in bytes)"
        )
    if n > len(body):
        raise InvalidArgument(
            f"Inference-Header-Content-Length is {header_length!r} but the body is {len(body)} bytes long"
        )
    return body[:n], memoryview(body)[n:]


def _header_hint(length: str | None, head: bytes, error: orjson.JSONDecodeError) -> str:
    """What to check where the JSON of a request that may carry binary data does not parse: a hand-written one
    (curl, a client of its own) was told its JSON was broken, not what the header is for."""
    if length is not None:
        return f" (Inference-Header-Content-Length says the JSON is the body's first {len(head)} bytes)"
    if error.msg.startswith("unexpected content after document"):
        return (
            "; binary tensor data after the JSON needs the Inference-Header-Content-Length header (the JSON's "
            "length in bytes)"
        )
    return ""


def _values(tensor: InputTensor) -> list[Any]:
    """Row-major values of an input's `data`: a JSON array, flat or nested, as Triton reads it (which
    refuses a bare value), of its datatype's JSON type."""
    if not isinstance(tensor.data, list):
        raise InvalidArgument(f"input {tensor.name!r}: data must be a JSON array (flat or nested, row-major)")
    values = _flatten(tensor.data)
    # Counted before each value's type is checked, as raw contents are before they are decoded.
    check_count(tensor.name, tensor.shape, len(values), tensor.datatype)
    kind, plural = JSON_TYPES[tensor.datatype]

    def fits(value: Any) -> bool:
        return isinstance(value, kind) and not isinstance(value, bool)  # JSON's true is no integer

    if not all(map(fits, values)):
        bad = next(v for v in values if not fits(v))
        # orjson reads an integer past 64 bits as a float (-2**63 - 1 as -2.0**63): an integer still, outside INT64.
        if kind is int and isinstance(bad, float) and abs(bad) >= 2**63:
            raise outside_int64(tensor.name)
        raise InvalidArgument(f"input {tensor.name!r} is {tensor.datatype}: its data must be {plural}")
    return values


def _flatten(data: list[Any]) -> list[Any]:
    # Without recursion: orjson reads arrays nested 1,024 deep, past Python's recursion limit.
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def _parameter(parameters: dict[str, Any], key: str, want: type[ParamT]) -> ParamT | None:
    """A parameter's value, if set: a JSON value of its type (an integer is no flag: Python's bool is an int,
    JSON's true is not a number). A null parameter is unset: clients serialise an optional field they leave
    unset as null (pydantic's models, Go's pointers), as the OpenAI route reads `dimensions: null`."""
    value = parameters.get(key)
    if value is None:
        return None
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise InvalidArgument(f"parameter {key!r} must be {PARAMETER_TYPES[want]}, got {type(value).__name__}")
    return value


class _Binary:
    """The binary inputs after the JSON, handed out in input order."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def take(self, tensor: InputTensor) -> bytes | None:
        size = tensor.parameters.get(BINARY_SIZE)
        if size is None:
            return None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidArgument(f"input {tensor.name!r}: {BINARY_SIZE} must be a byte count, got {size!r}")
        if self.pos + size > len(self.data):
            raise InvalidArgument(
                f"input {tensor.name!r} claims {size} bytes of binary data but {len(self.data) - self.pos} remain"
            )
        chunk = bytes(self.data[self.pos : self.pos + size])
        self.pos += size
        return chunk

    def check_used(self) -> None:
        if self.pos != len(self.data):
            raise InvalidArgument(f"{len(self.data) - self.pos} bytes of binary data that no input claims")


def from_request(req: InferenceRequest, binary: _Binary, model: str, version: str | None) -> EncodeInput:
    """The internal request; INVALID_ARGUMENT for anything malformed (the same messages as over gRPC)."""
    check_outputs([(out.name, out.parameters, bool(out.parameters.get("classification"))) for out in req.outputs])
    options = request_options(partial(_parameter, req.parameters))
    tensors: dict[str, Tensor] = {}
    for tensor in req.inputs:
        check_input(tensor.name, tensor.datatype, tensor.parameters, tensors)
        if tensor.data is not None and tensor.parameters.get(BINARY_SIZE) is not None:  # null: unset
            raise InvalidArgument(f"input {tensor.name!r} sets both 'data' and {BINARY_SIZE}: use one or the other")
        raw = binary.take(tensor)
        if raw is None and tensor.data is None:
            raise InvalidArgument(f"input {tensor.name!r} has no data (neither 'data' nor {BINARY_SIZE})")
        tensors[tensor.name] = Tensor(tensor.name, tensor.shape, raw, partial(_values, tensor))
    binary.check_used()
    return encode_input(tensors, options, model=model, version=version)


def _wants_binary(req: InferenceRequest) -> bool:
    """Triton's binary data extension: `binary_data_output` for every output, unless an output's own
    `binary_data` says otherwise (tritonclient sets the latter on each output it asks for)."""
    default = bool(_parameter(req.parameters, "binary_data_output", bool))
    wanted = [_parameter(out.parameters, "binary_data", bool) for out in req.outputs]
    return any(default if w is None else w for w in wanted) if wanted else default


def to_response(output: EncodeOutput, request_id: str, binary: bool) -> Response:
    embeddings = np.ascontiguousarray(output.embeddings, dtype="<f4")
    tensor: dict[str, Any] = {"name": OUTPUT, "datatype": "FP32", "shape": list(embeddings.shape)}
    header: dict[str, Any] = {
        "model_name": output.model,
        "model_version": str(output.version),
        "parameters": {"input_tokens": output.input_tokens},
        "outputs": [tensor],
    }
    if request_id:
        header["id"] = request_id
    if not binary:
        tensor["data"] = embeddings.reshape(-1)
        return json_response(header)
    raw = embeddings.tobytes()
    tensor["parameters"] = {BINARY_SIZE: len(raw)}
    head = orjson.dumps(header)
    return Response(
        head + raw,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(head))},
    )


class RepositoryIndexRequest(Body):
    ready: StrictBool = False


class RepositoryLoadRequest(Body):
    parameters: dict[str, Any] = Field(default_factory=dict)


REPOSITORY_PREFIX = f"{PREFIX}/repository"


def router(dataplane: DataPlane, manager: ModelManager) -> APIRouter:
    """The Open Inference Protocol's REST routes over the data plane."""
    api = APIRouter(prefix=PREFIX, tags=["Open Inference Protocol (KServe v2)"])

    def ready_status(yes: bool, /, **body: Any) -> Response:
        """The status says it, as Triton's answers do (tritonclient reads it alone); the body is the protocol's
        ($live_server_response, $ready_server_response, $ready_model_response), which KServe's REST client
        parses (it raised on an empty one)."""
        return json_response(body, 200 if yes else 400)

    @api.get("", summary="Server metadata")
    async def server_metadata() -> Response:
        return json_response({"name": SERVER_NAME, "version": server_version(), "extensions": list(EXTENSIONS)})

    @api.get("/health/live", summary="200 while the process runs", **health_answer("live", None, live="boolean"))
    async def live() -> Response:
        return ready_status(True, live=True)

    @api.get(
        "/health/ready",
        summary="200 when the server serves, 400 while it loads or drains",
        **health_answer("ready", "loading or draining", ready="boolean"),
    )
    async def ready() -> Response:
        return ready_status(dataplane.ready, ready=dataplane.ready)

    # Before /models/{name}: `stats` is not a model's name here.
    @api.get("/models/stats", summary="Statistics of every served model (Triton's statistics extension)")
    async def all_stats() -> Response:
        return json_response({"model_stats": [statistics(p) for p in dataplane.pipelines()]})

    for versioned in (False, True):
        base = "/models/{model_name}" + ("/versions/{model_version}" if versioned else "")
        _model_routes(api, dataplane, base, ready_status, _path_version if versioned else _latest_version)
    _repository_routes(api, manager)
    return api


async def _optional_json(request: Request) -> Any:
    """A repository call's body: tritonclient sends none, or JSON. Read as JSON whatever its Content-Type says,
    as /infer's is (tritonclient declares none, `curl -d` a form)."""
    body = await request.body()
    return parse_json(body, None) if body else {}


def _repository_routes(api: APIRouter, manager: ModelManager) -> None:
    """Triton's model repository extension over HTTP, as tritonclient.http calls it."""

    @api.post(
        "/repository/index",
        summary="Every model of the repository and each version's state (READY, LOADING, UNAVAILABLE and why)",
        openapi_extra=request_body(RepositoryIndexRequest, required=False),
    )
    async def repository_index(request: Request) -> Response:
        req = validate(RepositoryIndexRequest, await _optional_json(request))
        return json_response([dataclasses.asdict(e) for e in await manager.index(ready_only=req.ready)])

    @api.post(
        "/repository/models/{model_name}/load",
        summary="Load (or reload) a model by its version policy: --model-control explicit",
        openapi_extra=request_body(RepositoryLoadRequest, required=False),
        **status_only("loaded (and serving)"),
    )
    async def repository_load(request: Request, model_name: str) -> Response:
        manager.check_control()
        parameters = validate(RepositoryLoadRequest, await _optional_json(request)).parameters
        # (a parameter null is unset, as an inference request's)
        await manager.load_model(model_name, parameters=[k for k, v in parameters.items() if v is not None])
        return Response(status_code=200)

    @api.post(
        "/repository/models/{model_name}/unload", summary="Unload every version of a model", **status_only("unloaded")
    )
    async def repository_unload(request: Request, model_name: str) -> Response:
        manager.check_control()
        await _optional_json(request)
        await manager.unload_model(model_name)
        return Response(status_code=200)


def _path_version(model_version: str) -> str:
    """A versioned route's version: the one its path names."""
    return model_version


def _latest_version() -> str:
    """An unversioned route's version: none, the latest served. The protocol names a version in the path only; a
    handler parameter for it on these routes would be read from the query (FastAPI's rule for a parameter not
    in the path), an undocumented `?model_version=` that /openapi.json listed."""
    return ""


def _model_routes(
    api: APIRouter, dataplane: DataPlane, base: str, ready_status: Any, version: Callable[..., str]
) -> None:
    """The per-model routes, at /models/{name} and at /models/{name}/versions/{version}, whose `version` dependency
    gives the version their path names ("" for the latest served)."""

    @api.get(base, summary="Model metadata")
    async def model_metadata(model_name: str, model_version: str = Depends(version)) -> Response:
        pipeline = dataplane.resolve(model_name, model_version)
        return json_response(metadata(pipeline.model, dataplane.versions(pipeline.model.name)))

    @api.get(
        base + "/ready",
        summary="200 when the model is ready, 400 when not (or not served)",
        **health_answer("ready", "not ready, or not served", name="string", ready="boolean"),
    )
    async def model_ready(model_name: str, model_version: str = Depends(version)) -> Response:
        ready = model_is_ready(dataplane, model_name, model_version)
        return ready_status(ready, name=model_name, ready=ready)

    @api.get(base + "/config", summary="Triton's model configuration")
    async def model_config(model_name: str, model_version: str = Depends(version)) -> Response:
        return json_response(config(dataplane.resolve(model_name, model_version)))

    @api.get(base + "/stats", summary="Triton's model statistics")
    async def model_stats(model_name: str, model_version: str = Depends(version)) -> Response:
        return json_response(
            {"model_stats": [statistics(p) for p in statistics_of(dataplane, model_name, model_version)]}
        )

    @api.post(
        base + "/infer",
        summary="Inference: text or token ids in, embeddings out (JSON, or Triton's binary tensor data)",
        openapi_extra=request_body(InferenceRequest, "application/json", "application/octet-stream"),
        responses={200: {"content": {"application/octet-stream": {}}}},  # binary outputs after the JSON header
    )
    async def infer(request: Request, model_name: str, model_version: str = Depends(version)) -> Response:
        pipeline = dataplane.resolve(model_name, model_version)
        t0 = time.perf_counter_ns()
        try:
            length = request.headers.get(HEADER_LENGTH)
            head, binary = _split(await request.body(), length)
            try:
                data = loads(head.removeprefix(BOM))  # as parse_json: a byte order mark before it ignored
            except orjson.JSONDecodeError as e:
                raise InvalidArgument(
                    f"the inference request is not valid JSON: {not_json(head, e)}{_header_hint(length, head, e)}"
                ) from None
            req = validate(InferenceRequest, data)
            if (inputs := declared_inputs({t.name: t.shape for t in req.inputs})) is not None:
                pipeline.validate_count(inputs)  # before the data is flattened and decoded, value by value
            encode_input = from_request(req, _Binary(binary), model_name, model_version or None)
            as_binary = _wants_binary(req)  # a bad flag is refused before the model runs, not after
        except ServiceError as e:
            pipeline.refused(e, t0)  # at this boundary rather than in the pipeline: still a failed request
            raise
        output = await pipeline.encode(encode_input)
        return to_response(output, req.id, as_binary)
