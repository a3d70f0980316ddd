"""ModelInferRequest -> EncodeInput and EncodeOutput -> ModelInferResponse: the Open Inference Protocol's
gRPC wire, decoded into the checks of tensors.py.

Tensors are accepted in raw_input_contents or in typed contents (`int64_contents`, `bytes_contents`),
not both. The output always goes in raw_output_contents (tritonclient decodes only raw or bytes outputs).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, TypeAlias

import numpy as np

from mhaserve.proto.inference.v2 import grpc_service_pb2 as pb
from mhaserve.runtime.errors import InvalidArgument, ServiceError
from mhaserve.service.errors import to_status
from mhaserve.service.kserve.tensors import (
    EXPECTED_INPUTS,
    INPUT_TYPES,
    OUTPUT,
    PARAMETER_TYPES,
    ParamT,
    Tensor,
    check_input,
    check_outputs,
    declared_inputs,
    encode_input,
    request_options,
)
from mhaserve.service.pipeline import EncodeInput, EncodeOutput

InputTensor: TypeAlias = pb.ModelInferRequest.InferInputTensor
TYPED_FIELD = {"BYTES": "bytes_contents", "INT64": "int64_contents"}
PARAMETER_FIELD = {bool: "bool_param", str: "string_param", int: "int64_param"}  # tritonclient's for each


def _classification(parameters: Mapping[str, pb.InferParameter]) -> bool:
    """Whether a requested output asks for top classes (tritonclient's class_count, sent as "classification")."""
    if "classification" not in parameters:
        return False
    value = parameters["classification"]
    choice = value.WhichOneof("parameter_choice")
    return choice is not None and bool(getattr(value, choice))


def check_counts(request: pb.ModelInferRequest) -> None:
    """More outputs than the model has, or more input tensors than it takes, refused by their number (len() of a
    repeated field) before any one is read: reading each of 2,000,000 empty outputs of a 4 MB request (an
    output's parameters cost more the more there are) held the event loop for seconds, health checks waiting,
    and the request was then refused for its first one."""
    if len(request.outputs) > 1:
        raise InvalidArgument(
            f"{len(request.outputs)} outputs requested; the limit is 1: this model has one output, {OUTPUT!r}"
        )
    if len(request.inputs) > len(INPUT_TYPES):
        raise InvalidArgument(
            f"{len(request.inputs)} input tensors in one request; the limit is {len(INPUT_TYPES)}: this model takes "
            f"{EXPECTED_INPUTS}"
        )


def declared(request: pb.ModelInferRequest) -> int | None:
    """How many inputs the request's tensors declare (`declared_inputs`), its tensors counted first."""
    check_counts(request)
    return declared_inputs({t.name: t.shape for t in request.inputs})


def from_pb(request: pb.ModelInferRequest) -> EncodeInput:
    """The internal request a ModelInferRequest asks for; INVALID_ARGUMENT for anything malformed."""
    check_counts(request)
    check_outputs([(out.name, out.parameters, _classification(out.parameters)) for out in request.outputs])
    options = request_options(partial(_parameter, request.parameters))
    return encode_input(_inputs(request), options, model=request.model_name, version=request.model_version or None)


def _parameter(parameters: Mapping[str, pb.InferParameter], key: str, want: type[ParamT]) -> ParamT | None:
    """A request parameter's value, if set: it must be set in the oneof field of its type."""
    if key not in parameters:
        return None
    kind = parameters[key].WhichOneof("parameter_choice")
    field = PARAMETER_FIELD[want]
    if kind != field:
        raise InvalidArgument(f"parameter {key!r} must be {PARAMETER_TYPES[want]} ({field}), got {kind or 'no value'}")
    value: ParamT = getattr(parameters[key], field)
    return value


def _inputs(request: pb.ModelInferRequest) -> dict[str, Tensor]:
    """Each input by name, with its raw contents when the request uses raw_input_contents."""
    # Every input checked before the raw contents are counted: one in shared memory has none, and is refused
    # as such rather than for the count.
    seen: set[str] = set()
    for tensor in request.inputs:
        check_input(tensor.name, tensor.datatype, tensor.parameters, seen)
        seen.add(tensor.name)
    raw = request.raw_input_contents  # not copied: 2,000,000 empty entries are refused by their count below
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
    return {
        tensor.name: Tensor(tensor.name, tensor.shape, raw[i] if raw else None, partial(_typed, tensor))
        for i, tensor in enumerate(request.inputs)
    }


def _typed(tensor: InputTensor) -> Any:
    """The one typed-contents field of the tensor's datatype; INVALID_ARGUMENT if another is used."""
    want = TYPED_FIELD[tensor.datatype]
    others = [f.name for f, _ in tensor.contents.ListFields() if f.name != want]
    if others:
        raise InvalidArgument(
            f"input {tensor.name!r} is {tensor.datatype}: its values go in contents.{want}, not contents.{others[0]}"
        )
    return getattr(tensor.contents, want)


FINAL_RESPONSE = "triton_final_response"  # Triton's, on every stream answer: whether it is its request's last


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


def stream_pb(response: pb.ModelInferResponse) -> pb.ModelStreamInferResponse:
    """A request's answer in a stream, marked as its last (`triton_final_response`), as Triton marks each answer
    of a model that is not decoupled: clients read a stream's answers to a request until they see it."""
    response.parameters[FINAL_RESPONSE].bool_param = True
    return pb.ModelStreamInferResponse(infer_response=response)


def error_pb(request: pb.ModelInferRequest, error: ServiceError) -> pb.ModelStreamInferResponse:
    """A failed request in a stream: its status code name and message, and its id to match it by; the last
    answer to it, as Triton marks a failed request's."""
    code, message = to_status(error)
    return pb.ModelStreamInferResponse(
        error_message=f"{code.name}: {message}",
        infer_response=pb.ModelInferResponse(
            model_name=request.model_name,
            model_version=request.model_version,
            id=request.id,
            parameters={FINAL_RESPONSE: pb.InferParameter(bool_param=True)},
        ),
    )
