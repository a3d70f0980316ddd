"""ModelInferRequest -> EncodeInput and EncodeOutput -> ModelInferResponse: the Open Inference Protocol's
gRPC wire, decoded into the checks of tensors.py.

Tensors are accepted in raw_input_contents or in typed contents (`int64_contents`, `bytes_contents`),
not both. The output always goes in raw_output_contents (tritonclient decodes only raw or bytes outputs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from mhaserve.proto.inference.v2 import grpc_service_pb2 as pb
from mhaserve.runtime.errors import InvalidArgument, ServiceError
from mhaserve.service.errors import to_status
from mhaserve.service.kserve.tensors import (
    BOOL_PARAMETERS,
    IDS_SHAPES,
    OUTPUT,
    STRING_PARAMETERS,
    TEXT,
    TEXT_SHAPES,
    check_input,
    check_outputs,
    check_shape,
    count_error,
    decode_texts,
    encode_input,
    unpack_bytes,
)
from mhaserve.service.pipeline import EncodeInput, EncodeOutput

InputTensor: TypeAlias = pb.ModelInferRequest.InferInputTensor
TYPED_FIELD = {"BYTES": "bytes_contents", "INT64": "int64_contents"}


def _classification(parameters: Mapping[str, pb.InferParameter]) -> bool:
    """Whether a requested output asks for top classes (tritonclient's class_count, sent as "classification")."""
    if "classification" not in parameters:
        return False
    value = parameters["classification"]
    choice = value.WhichOneof("parameter_choice")
    return choice is not None and bool(getattr(value, choice))


def from_pb(request: pb.ModelInferRequest) -> EncodeInput:
    """The internal request a ModelInferRequest asks for; INVALID_ARGUMENT for anything malformed."""
    check_outputs([(out.name, _classification(out.parameters)) for out in request.outputs])
    truncate, normalize, prompt_name = _options(request.parameters)
    tensors = _inputs(request)
    decoders = {
        name: (lambda t=tensor, r=raw: _texts(t, r)) if name == TEXT else (lambda t=tensor, r=raw: _int64(t, r))
        for name, (tensor, raw) in tensors.items()
    }
    return encode_input(
        decoders,
        model=request.model_name,
        version=request.model_version or None,
        truncate=truncate,
        normalize=normalize,
        prompt_name=prompt_name,
    )


def _options(parameters: Mapping[str, pb.InferParameter]) -> tuple[bool, bool | None, str | None]:
    """(truncate, normalize, prompt_name) from the mhaserve parameters; others are ignored, as Triton does."""
    options: dict[str, bool] = {}
    for key in BOOL_PARAMETERS:
        if key in parameters:
            kind = parameters[key].WhichOneof("parameter_choice")
            if kind != "bool_param":
                raise InvalidArgument(f"parameter {key!r} must be a bool (bool_param), got {kind or 'no value'}")
            options[key] = parameters[key].bool_param
    prompt_name = None
    for key in STRING_PARAMETERS:
        if key in parameters:
            kind = parameters[key].WhichOneof("parameter_choice")
            if kind != "string_param":
                raise InvalidArgument(f"parameter {key!r} must be a string (string_param), got {kind or 'no value'}")
            prompt_name = parameters[key].string_param or None
    return options.get("truncate", False), options.get("normalize"), prompt_name


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
        check_input(tensor.name, tensor.datatype, tensors)
        tensors[tensor.name] = (tensor, raw[i] if raw else None)
    return tensors


def _typed(tensor: InputTensor) -> Any:
    """The one typed-contents field of the tensor's datatype; INVALID_ARGUMENT if another is used."""
    want = TYPED_FIELD[tensor.datatype]
    others = [f.name for f, _ in tensor.contents.ListFields() if f.name != want]
    if others:
        raise InvalidArgument(
            f"input {tensor.name!r} is {tensor.datatype}: its values go in contents.{want}, not contents.{others[0]}"
        )
    return getattr(tensor.contents, want)


def _int64(tensor: InputTensor, raw: bytes | None) -> npt.NDArray[np.int64]:
    n = check_shape(tensor.name, tensor.shape, IDS_SHAPES, "[rows, tokens]")
    if raw is not None:
        if len(raw) != 8 * n:
            raise count_error(tensor.name, tensor.shape, n, f"{len(raw)} bytes (expected {8 * n}: 8 per INT64)")
        values = np.frombuffer(raw, dtype="<i8")
    else:
        typed = _typed(tensor)
        if len(typed) != n:
            raise count_error(tensor.name, tensor.shape, n, f"{len(typed)} values")
        values = np.asarray(typed, dtype=np.int64)
    return values.astype(np.int64, copy=False).reshape(tuple(tensor.shape))


def _texts(tensor: InputTensor, raw: bytes | None) -> list[str]:
    n = check_shape(tensor.name, tensor.shape, TEXT_SHAPES, "[n] (or [n, 1])")
    items = unpack_bytes(raw, tensor.name) if raw is not None else list(_typed(tensor))
    if len(items) != n:
        raise count_error(tensor.name, tensor.shape, n, f"{len(items)} elements")
    return decode_texts(tensor.name, items)


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
