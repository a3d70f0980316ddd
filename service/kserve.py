"""inference.GRPCInferenceService: the Open Inference Protocol (KServe v2) with Triton's extensions.

Triton's clients, dashboards and perf tools speak this protocol; mhaserve answers it on the same port
as encoder.v1. At the boundary `from_pb` turns a ModelInferRequest into the one internal request,
`EncodeInput`, and `to_pb` an `EncodeOutput` into a ModelInferResponse; in between runs the same
Pipeline (validation, limits, batcher, metrics) and errors go through the same interceptor and map.

The model, as the protocol sees it:
- inputs: `text` BYTES [-1] (UTF-8, tokenised by the server), or `input_ids` and `attention_mask`
  INT64 [-1, -1] (rows padded on the right; the mask strips the padding so the batcher can re-pack
  the rows with other requests');
- output: `embeddings` FP32 [-1, dim], always in raw_output_contents (tritonclient decodes only raw
  or bytes outputs);
- request parameters (an mhaserve extension): `normalize` and `truncate`, both bool_param, as in
  encoder.v1's EncodeRequest; the response carries `input_tokens` (int64_param).
Tensors are accepted in raw_input_contents or in typed contents (`int64_contents`, `bytes_contents`),
not both. Version "" means the served version; any other version than the served one is NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import struct
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from functools import cache
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any, TypeAlias

import grpc
import grpc.aio
import numpy as np
import numpy.typing as npt

from proto.inference.v2 import grpc_service_pb2 as pb
from proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from proto.inference.v2 import model_config_pb2 as mc
from service.errors import InvalidArgument, NotFound, ServiceError, Unavailable, to_status
from service.pipeline import EncodeInput, EncodeOutput, Pipeline
from service.repository import LoadedModel
from service.servicer import STREAM_FATAL, STREAM_WINDOW

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
InputTensor: TypeAlias = pb.ModelInferRequest.InferInputTensor
_Pending: TypeAlias = "tuple[pb.ModelInferRequest, asyncio.Task[pb.ModelInferResponse]] | None"

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
# Methods that answer while the model loads and while the server drains (with false), like grpc.health.v1.
HEALTH_METHODS = tuple(f"/{SERVICE}/{m}" for m in ("ServerLive", "ServerReady", "ModelReady"))
SERVER_NAME = "mhaserve"
# Triton's names for what this server implements beyond the core protocol.
EXTENSIONS = ("model_configuration", "parameters", "statistics")
PLATFORM = "onnxruntime_onnx"
BACKEND = "onnxruntime"

TEXT, IDS, MASK, OUTPUT = "text", "input_ids", "attention_mask", "embeddings"
INPUT_TYPES = {TEXT: "BYTES", IDS: "INT64", MASK: "INT64"}
TYPED_FIELD = {"BYTES": "bytes_contents", "INT64": "int64_contents"}
BOOL_PARAMETERS = ("normalize", "truncate")
EXPECTED_INPUTS = f"{TEXT!r} (BYTES [-1]) or {IDS!r} and {MASK!r} (INT64 [-1, -1])"


# ---- ModelInferRequest -> EncodeInput --------------------------------------------------------------


def from_pb(request: pb.ModelInferRequest) -> EncodeInput:
    """The internal request a ModelInferRequest asks for; INVALID_ARGUMENT for anything malformed."""
    for out in request.outputs:
        if out.name != OUTPUT:
            raise InvalidArgument(f"unknown output {out.name!r}: this model has one output, {OUTPUT!r}")
    truncate, normalize = _options(request.parameters)
    tensors = _inputs(request)
    if TEXT in tensors:
        if IDS in tensors or MASK in tensors:
            raise InvalidArgument(f"set either {TEXT!r} or {IDS!r} and {MASK!r}, not both")
        texts = _texts(*tensors[TEXT])
        return EncodeInput(texts=texts, model=request.model_name, truncate=truncate, normalize=normalize)
    missing = [name for name in (IDS, MASK) if name not in tensors]
    if len(missing) == 2:
        raise InvalidArgument(f"missing input: set {EXPECTED_INPUTS}")
    if missing:
        raise InvalidArgument(f"missing input {missing[0]!r}: {IDS!r} and {MASK!r} go together")
    ids, mask = _int64(*tensors[IDS]), _int64(*tensors[MASK])
    if ids.shape != mask.shape:
        raise InvalidArgument(
            f"{IDS!r} has shape {list(ids.shape)} and {MASK!r} has shape {list(mask.shape)}: they must be the same"
        )
    rows = strip_padding(ids, mask)
    return EncodeInput(token_ids=rows, model=request.model_name, truncate=truncate, normalize=normalize)


def _options(parameters: Mapping[str, pb.InferParameter]) -> tuple[bool, bool | None]:
    """(truncate, normalize) from the mhaserve parameters; other parameters are ignored, as Triton does."""
    options: dict[str, bool] = {}
    for key in BOOL_PARAMETERS:
        if key in parameters:
            kind = parameters[key].WhichOneof("parameter_choice")
            if kind != "bool_param":
                raise InvalidArgument(f"parameter {key!r} must be a bool (bool_param), got {kind or 'no value'}")
            options[key] = parameters[key].bool_param
    return options.get("truncate", False), options.get("normalize")


def _inputs(request: pb.ModelInferRequest) -> dict[str, tuple[InputTensor, bytes | None]]:
    """Each input by name, with its raw contents when the request uses raw_input_contents."""
    raw = list(request.raw_input_contents)
    if raw:
        typed = [t.name for t in request.inputs if t.HasField("contents")]
        if typed:
            raise InvalidArgument(
                f"input {typed[0]!r} sets contents and the request sets raw_input_contents: use one or the other"
            )
        if len(raw) != len(request.inputs):
            raise InvalidArgument(
                f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: give one per input, in input order"
            )
    tensors: dict[str, tuple[InputTensor, bytes | None]] = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.name not in INPUT_TYPES:
            raise InvalidArgument(f"unknown input {tensor.name!r}: this model takes {EXPECTED_INPUTS}")
        if tensor.name in tensors:
            raise InvalidArgument(f"input {tensor.name!r} is given twice")
        expected = INPUT_TYPES[tensor.name]
        if tensor.datatype != expected:
            raise InvalidArgument(
                f"input {tensor.name!r} has datatype {tensor.datatype or '(none)'}; expected {expected}"
            )
        tensors[tensor.name] = (tensor, raw[i] if raw else None)
    return tensors


def _elements(tensor: InputTensor, ranks: Sequence[tuple[int | None, ...]], expected: str) -> int:
    """Check the shape against the allowed forms (None: any size) and return its element count."""
    shape = list(tensor.shape)
    fits = any(
        len(shape) == len(form) and all(want is None or want == got for want, got in zip(form, shape, strict=True))
        for form in ranks
    )
    if not fits or any(d < 0 for d in shape):
        raise InvalidArgument(f"input {tensor.name!r} has shape {shape}; expected {expected}")
    return math.prod(shape)


def _typed(tensor: InputTensor) -> Any:
    """The one typed-contents field of the tensor's datatype; INVALID_ARGUMENT if another is used."""
    want = TYPED_FIELD[tensor.datatype]
    others = [f.name for f, _ in tensor.contents.ListFields() if f.name != want]
    if others:
        raise InvalidArgument(
            f"input {tensor.name!r} is {tensor.datatype}: its values go in contents.{want}, not contents.{others[0]}"
        )
    return getattr(tensor.contents, want)


def _count_error(tensor: InputTensor, elements: int, given: str) -> InvalidArgument:
    return InvalidArgument(
        f"input {tensor.name!r} has shape {list(tensor.shape)} ({elements} elements) but its contents hold {given}"
    )


def _int64(tensor: InputTensor, raw: bytes | None) -> npt.NDArray[np.int64]:
    n = _elements(tensor, [(None, None)], "[rows, tokens]")
    if raw is not None:
        if len(raw) != 8 * n:
            raise _count_error(tensor, n, f"{len(raw)} bytes (expected {8 * n}: 8 per INT64)")
        values = np.frombuffer(raw, dtype="<i8")
    else:
        typed = _typed(tensor)
        if len(typed) != n:
            raise _count_error(tensor, n, f"{len(typed)} values")
        values = np.asarray(typed, dtype=np.int64)
    return values.astype(np.int64, copy=False).reshape(tuple(tensor.shape))


def unpack_bytes(raw: bytes, name: str = "") -> list[bytes]:
    """Triton's BYTES serialisation: each element a 4-byte little-endian length, then that many bytes."""
    out: list[bytes] = []
    pos, view = 0, memoryview(raw)
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise InvalidArgument(
                f"input {name!r}: raw BYTES contents end inside the 4-byte length of element {len(out)} "
                f"(at byte {pos} of {len(raw)})"
            )
        (length,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + length > len(raw):
            raise InvalidArgument(
                f"input {name!r}: raw BYTES element {len(out)} claims {length} bytes but {len(raw) - pos} remain"
            )
        out.append(bytes(view[pos : pos + length]))
        pos += length
    return out


def pack_bytes(items: Sequence[bytes]) -> bytes:
    """The inverse of `unpack_bytes`."""
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def _texts(tensor: InputTensor, raw: bytes | None) -> list[str]:
    # [n], or [n, 1] as Triton's string-input examples send it.
    n = _elements(tensor, [(None,), (None, 1)], "[n] (or [n, 1])")
    items = unpack_bytes(raw, tensor.name) if raw is not None else list(_typed(tensor))
    if len(items) != n:
        raise _count_error(tensor, n, f"{len(items)} elements")
    texts = []
    for i, item in enumerate(items):
        try:
            texts.append(item.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InvalidArgument(
                f"input {tensor.name!r} element {i} is not UTF-8 (byte {e.start}: {item[e.start : e.start + 1]!r}); "
                "send text as UTF-8 bytes"
            ) from None
    return texts


def strip_padding(ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64]) -> list[npt.NDArray[np.int64]]:
    """Each row's real tokens. The mask must hold only 0 and 1, ones first (padding on the right), one at least."""
    bad = mask[(mask != 0) & (mask != 1)]
    if bad.size:
        raise InvalidArgument(f"{MASK!r} holds {int(bad[0])}; it must hold only 0 and 1")
    lengths = mask.sum(axis=1)
    aligned = (mask == (np.arange(mask.shape[1]) < lengths[:, None])).all(axis=1)
    if not aligned.all():
        row = int(np.flatnonzero(~aligned)[0])
        raise InvalidArgument(
            f"{MASK!r} row {row} is not ones then zeros: padding must be on the right (got {mask[row].tolist()[:16]}"
            f"{' ...' if mask.shape[1] > 16 else ''})"
        )
    if (lengths == 0).any():
        row = int(np.flatnonzero(lengths == 0)[0])
        raise InvalidArgument(f"{MASK!r} row {row} is all zeros: every input needs at least one token")
    return [ids[r, : int(lengths[r])] for r in range(ids.shape[0])]


# ---- EncodeOutput -> ModelInferResponse ------------------------------------------------------------


def to_pb(output: EncodeOutput, request_id: str = "") -> pb.ModelInferResponse:
    embeddings = np.ascontiguousarray(output.embeddings, dtype="<f4")
    return pb.ModelInferResponse(
        model_name=output.model,
        model_version=str(output.version),
        id=request_id,
        parameters={"input_tokens": pb.InferParameter(int64_param=output.input_tokens)},
        outputs=[pb.ModelInferResponse.InferOutputTensor(name=OUTPUT, datatype="FP32", shape=embeddings.shape)],
        raw_output_contents=[embeddings.tobytes()],
    )


def error_pb(request: pb.ModelInferRequest, error: ServiceError) -> pb.ModelStreamInferResponse:
    """A failed request in a stream: its status code name and message, and its id to match it by."""
    code, message = to_status(error)
    return pb.ModelStreamInferResponse(
        error_message=f"{code.name}: {message}",
        infer_response=pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        ),
    )


# ---- metadata and configuration --------------------------------------------------------------------


@cache
def server_version() -> str:
    try:
        return package_version("mhaserve")
    except PackageNotFoundError:
        return "unknown"


def tensor_shapes(model: LoadedModel) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the model: datatype and full shape (batch dimension first, -1 for any size)."""
    return {
        TEXT: ("BYTES", [-1]),
        IDS: ("INT64", [-1, -1]),
        MASK: ("INT64", [-1, -1]),
        OUTPUT: ("FP32", [-1, model.entry.manifest.hidden_size]),
    }


def model_metadata(model: LoadedModel) -> pb.ModelMetadataResponse:
    meta = pb.ModelMetadataResponse.TensorMetadata
    shapes = tensor_shapes(model)
    return pb.ModelMetadataResponse(
        name=model.name,
        versions=[str(model.version)],
        platform=PLATFORM,
        inputs=[meta(name=n, datatype=shapes[n][0], shape=shapes[n][1]) for n in (TEXT, IDS, MASK)],
        outputs=[meta(name=OUTPUT, datatype=shapes[OUTPUT][0], shape=shapes[OUTPUT][1])],
    )


CONFIG_TYPES = {"BYTES": mc.TYPE_STRING, "INT64": mc.TYPE_INT64, "FP32": mc.TYPE_FP32}


def model_config(model: LoadedModel, pipeline: Pipeline) -> mc.ModelConfig:
    """Triton's view of the model. With max_batch_size > 0, dims leave out the batch dimension."""
    m, limits = model.entry.manifest, pipeline.limits
    shapes = tensor_shapes(model)
    return mc.ModelConfig(
        name=model.name,
        platform=PLATFORM,
        backend=BACKEND,
        version_policy=mc.ModelVersionPolicy(latest=mc.ModelVersionPolicy.Latest(num_versions=1)),
        max_batch_size=limits.max_client_batch_size,
        # All optional: a request sends text, or input_ids and attention_mask.
        input=[
            mc.ModelInput(name=n, data_type=CONFIG_TYPES[shapes[n][0]], dims=shapes[n][1][1:], optional=True)
            for n in (TEXT, IDS, MASK)
        ],
        output=[mc.ModelOutput(name=OUTPUT, data_type=mc.TYPE_FP32, dims=shapes[OUTPUT][1][1:])],
        dynamic_batching=mc.ModelDynamicBatching(
            max_queue_delay_microseconds=round(limits.max_wait_ms * 1000),
            preserve_ordering=True,
            # mhaserve's queue limit counts inputs (rows), not requests.
            default_queue_policy=mc.ModelQueuePolicy(max_queue_size=limits.max_queue_size),
        ),
        instance_group=[
            mc.ModelInstanceGroup(
                name=model.name,
                kind=mc.ModelInstanceGroup.KIND_GPU if model.on_cuda else mc.ModelInstanceGroup.KIND_CPU,
                count=1,
            )
        ],
        default_model_filename=model.entry.graph_path.name,
        parameters={
            key: mc.ModelParameter(string_value=str(value))
            for key, value in {
                "max_batch_tokens": limits.max_batch_tokens,
                "max_padding": limits.max_padding,
                "max_tokens_per_input": m.max_seq_len,
                "vocab_size": m.vocab_size,
                "pooling": m.pooling,
                "normalize": str(m.normalize).lower(),
                "graph": model.entry.graph,
                "execution_provider": model.provider,
                "sha256": model.entry.sha256,
            }.items()
        },
    )


def model_statistics(model: LoadedModel, pipeline: Pipeline) -> pb.ModelStatistics:
    s = pipeline.stats.snapshot()

    def duration(d: Any) -> pb.StatisticDuration:
        return pb.StatisticDuration(count=d.count, ns=d.ns)

    return pb.ModelStatistics(
        name=model.name,
        version=str(model.version),
        last_inference=s.last_inference_ms,
        inference_count=s.inference_count,
        execution_count=s.execution_count,
        inference_stats=pb.InferStatistics(
            success=duration(s.success),
            fail=duration(s.fail),
            queue=duration(s.queue),
            compute_input=duration(s.compute_input),
            compute_infer=duration(s.compute_infer),
            compute_output=duration(s.compute_output),
        ),
    )


# ---- the servicer ----------------------------------------------------------------------------------


def served(pipeline: Pipeline, name: str, version: str) -> LoadedModel:
    """The model a request names at the version it names; NOT_FOUND for another model or version."""
    model = pipeline.resolve(name)
    if version and version != str(model.version):
        raise NotFound(f"model {model.name!r} version {version!r} is not served here (serving version {model.version})")
    return model


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The Open Inference Protocol. `pipeline()` is None until the model is loaded; `ready()` follows health."""

    def __init__(self, pipeline: Callable[[], Pipeline | None], *, ready: Callable[[], bool]) -> None:
        self._pipeline = pipeline
        self._ready = ready

    def pipeline(self) -> Pipeline:
        p = self._pipeline()
        if p is None:
            raise Unavailable("the model is not loaded yet")
        return p

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._ready() and self._pipeline() is not None)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        # A question, not a command: a model or version not served is simply not ready (as in Triton).
        pipeline = self._pipeline()
        if pipeline is None or not self._ready():
            return pb.ModelReadyResponse(ready=False)
        try:
            served(pipeline, request.name, request.version)
        except NotFound:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=server_version(), extensions=EXTENSIONS)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Context) -> pb.ModelMetadataResponse:
        return model_metadata(served(self.pipeline(), request.name, request.version))

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        pipeline = self.pipeline()
        return pb.ModelConfigResponse(config=model_config(served(pipeline, request.name, request.version), pipeline))

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Context) -> pb.ModelStatisticsResponse:
        pipeline = self.pipeline()
        model = served(pipeline, request.name, request.version)  # empty name and version: every model, i.e. this one
        return pb.ModelStatisticsResponse(model_stats=[model_statistics(model, pipeline)])

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        return await self._infer(self.pipeline(), request, context)

    async def _infer(
        self, pipeline: Pipeline, request: pb.ModelInferRequest, context: Context
    ) -> pb.ModelInferResponse:
        served(pipeline, request.model_name, request.model_version)
        t0 = time.perf_counter_ns()
        try:
            encode_input = from_pb(request)
        except ServiceError:
            # Refused at this boundary rather than in the pipeline: still a failed request for this model.
            pipeline.stats.failed(time.perf_counter_ns() - t0)
            raise
        output = await pipeline.encode(encode_input, time_left=context.time_remaining())
        return to_pb(output, request.id)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        # As encoder.v1's EncodeStream: up to STREAM_WINDOW requests computed at once (so they batch
        # together), responses in request order; a failed request gets error_message and the stream goes on.
        pipeline = self.pipeline()
        pending: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=STREAM_WINDOW)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await pending.put((request, asyncio.ensure_future(self._infer(pipeline, request, context))))
            finally:
                await pending.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (item := await pending.get()) is not None:
                request, task = item
                try:
                    response = await task
                except ServiceError as e:
                    if e.code in STREAM_FATAL:
                        raise
                    yield error_pb(request, e)
                else:
                    yield pb.ModelStreamInferResponse(infer_response=response)
            await reader  # re-raises a failure to read the stream
        finally:
            reader.cancel()
            while not pending.empty():
                if (left := pending.get_nowait()) is not None:
                    left[1].cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
