"""The Open Inference Protocol (inference.GRPCInferenceService) with our own stubs: conversion, status codes,
health, statistics, and that it shares encoder.v1's pipeline and batcher. Triton's own client is in
test_kserve_triton.py."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
from google.protobuf.descriptor_pb2 import FileDescriptorProto
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from mhaserve.proto.encoder.v1 import encoder_pb2 as epb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as epb_grpc
from mhaserve.proto.inference.v2 import grpc_service_pb2 as pb
from mhaserve.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from mhaserve.proto.inference.v2 import model_config_pb2 as mc
from mhaserve.runtime.errors import InvalidArgument
from mhaserve.service.kserve.codec import from_pb
from mhaserve.service.kserve.servicer import HEALTH_METHODS, SERVICE
from mhaserve.service.kserve.tensors import SHARED_MEMORY, pack_bytes, strip_padding, unpack_bytes
from mhaserve.service.rpc.interceptors import is_exempt
from mhaserve.service.server import ALWAYS_ANSWERED
from mhaserve.service.settings import Settings
from mhaserve.testing import http
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.loopback import WAIT, free_port, wait_until
from mhaserve.testing.server import ServerThread
from tests.conftest import TINY
from tests.service.conftest import REFUSALS

Start = Callable[..., ServerThread]
Tensor = pb.ModelInferRequest.InferInputTensor
MAX = TINY["max_seq_len"]
INFER = "inference.GRPCInferenceService/ModelInfer"
TEXTS = ["a", "hello world", "héllo wörld 🤖", "", "the quick brown fox jumps over the lazy dog"]


# ---- building requests -----------------------------------------------------------------------------


def text_request(texts: Sequence[str | bytes], *, raw: bool = True, shape: list[int] | None = None) -> Any:
    items = [t.encode() if isinstance(t, str) else t for t in texts]
    tensor = Tensor(name="text", datatype="BYTES", shape=[len(items)] if shape is None else shape)
    if raw:
        return pb.ModelInferRequest(model_name="tiny", inputs=[tensor], raw_input_contents=[pack_bytes(items)])
    tensor.contents.bytes_contents.extend(items)
    return pb.ModelInferRequest(model_name="tiny", inputs=[tensor])


def ids_request(ids: list[list[int]], mask: list[list[int]] | None = None, *, raw: bool = True) -> Any:
    """input_ids and attention_mask (all ones unless given) as INT64 tensors."""
    mask = [[1] * len(r) for r in ids] if mask is None else mask
    request = pb.ModelInferRequest(model_name="tiny")
    for name, rows in (("input_ids", ids), ("attention_mask", mask)):
        array = np.array(rows, dtype=np.int64).reshape(len(rows), -1)
        tensor = Tensor(name=name, datatype="INT64", shape=array.shape)
        if raw:
            request.raw_input_contents.append(array.astype("<i8").tobytes())
        else:
            tensor.contents.int64_contents.extend(array.ravel().tolist())
        request.inputs.append(tensor)
    return request


def embeddings(response: pb.ModelInferResponse) -> npt.NDArray[np.float32]:
    (out,) = response.outputs
    assert (out.name, out.datatype) == ("embeddings", "FP32")
    return np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(tuple(out.shape))


def vectors(response: epb.EncodeResponse) -> npt.NDArray[np.float32]:
    return np.array([e.values for e in response.embeddings], dtype=np.float32)


def bool_param(value: bool) -> pb.InferParameter:
    return pb.InferParameter(bool_param=value)


# ---- conversion, without a server ------------------------------------------------------------------


def test_bytes_serialisation_round_trips() -> None:
    items = [b"", b"a", "héllo 🤖".encode(), bytes(range(256))]
    packed = pack_bytes(items)
    assert packed[:4] == b"\x00\x00\x00\x00" and packed[4:8] == b"\x01\x00\x00\x00"  # 4-byte little-endian lengths
    assert unpack_bytes(packed, "text", [len(items)]) == items
    assert unpack_bytes(b"", "text", [0]) == []


# Packed elements past a tensor's shape, then one that claims 9 bytes and holds 3: malformed, and read only if the
# elements past the shape's count are.
PAST_THE_SHAPE = pack_bytes([b"a", b"b"]) + b"\x09\x00\x00\x00abc"


def test_raw_bytes_are_refused_by_count_once_they_hold_one_element_past_the_shape() -> None:
    """Counted as they are read: a million empty elements for a shape of [1] were all unpacked (1.25 s of the
    event loop) before the count refused them. Element n + 2 is malformed: its error would mean it was read."""
    with pytest.raises(InvalidArgument) as e:
        unpack_bytes(PAST_THE_SHAPE, "text", [1])
    assert str(e.value) == "input 'text' has shape [1] (1 elements) but its contents hold at least 2 elements"
    request = pb.ModelInferRequest(
        model_name="tiny",
        inputs=[Tensor(name="text", datatype="BYTES", shape=[1])],
        raw_input_contents=[PAST_THE_SHAPE],
    )
    with pytest.raises(InvalidArgument, match=r"has shape \[1\] \(1 elements\) but its contents hold at least 2 el"):
        from_pb(request)
    # Within the shape, or one past it with nothing after, as before: every element read, the exact count given.
    assert unpack_bytes(pack_bytes([b"a", b"b"]), "text", [2]) == [b"a", b"b"]
    assert unpack_bytes(pack_bytes([b"a", b"b"]), "text", [1]) == [b"a", b"b"]  # refused by texts(): 2 elements


def test_raw_and_typed_contents_convert_alike() -> None:
    for raw in (True, False):
        assert list(from_pb(text_request(TEXTS, raw=raw)).texts) == TEXTS
        converted = from_pb(ids_request([[2, 5, 7, 0], [2, 9, 0, 0]], [[1, 1, 1, 0], [1, 1, 0, 0]], raw=raw))
        assert [list(map(int, r)) for r in converted.token_ids] == [[2, 5, 7], [2, 9]]  # padding stripped by the mask
    # [n, 1], as Triton's string-input examples send it
    assert list(from_pb(text_request(["x", "y"], shape=[2, 1])).texts) == ["x", "y"]


def test_parameters_become_the_request_options() -> None:
    request = text_request(["x"])
    assert (from_pb(request).normalize, from_pb(request).truncate) == (None, None)  # None: the server's choice
    request.parameters["truncate"].CopyFrom(bool_param(False))
    assert from_pb(request).truncate is False  # said, so it wins over --auto-truncate
    request.parameters["normalize"].CopyFrom(bool_param(False))
    request.parameters["truncate"].CopyFrom(bool_param(True))
    request.parameters["priority"].CopyFrom(pb.InferParameter(int64_param=1))  # Triton's: ignored
    converted = from_pb(request)
    assert (converted.normalize, converted.truncate) == (False, True)


def test_strip_padding_wants_ones_then_zeros() -> None:
    ids = np.arange(8, dtype=np.int64).reshape(2, 4)
    rows = strip_padding(ids, np.array([[1, 1, 1, 1], [1, 0, 0, 0]]))
    assert [r.tolist() for r in rows] == [[0, 1, 2, 3], [4]]
    for mask, message in (
        ([[1, 0, 1, 0], [1, 1, 1, 1]], "row 0 is not ones then zeros"),
        ([[0, 1, 1, 1], [1, 1, 1, 1]], "row 0 is not ones then zeros"),
        ([[1, 1, 1, 1], [0, 0, 0, 0]], "row 1 is all zeros"),
        ([[1, 1, 2, 1], [1, 1, 1, 1]], "holds 2; it must hold only 0 and 1"),
    ):
        with pytest.raises(InvalidArgument, match=message):
            strip_padding(ids, np.array(mask))


def test_the_v2_health_methods_pass_the_readiness_gate() -> None:
    assert all(is_exempt(m, ALWAYS_ANSWERED) for m in HEALTH_METHODS)


# ---- a real server -----------------------------------------------------------------------------------


@pytest.fixture
def stubs(server: ServerThread) -> Iterator[tuple[pb_grpc.GRPCInferenceServiceStub, epb_grpc.EncoderServiceStub]]:
    with server.channel() as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel), epb_grpc.EncoderServiceStub(channel)


@pytest.fixture
def stub(stubs: tuple[pb_grpc.GRPCInferenceServiceStub, Any]) -> pb_grpc.GRPCInferenceServiceStub:
    return stubs[0]


def test_infer_equals_encode_for_every_encoding(stubs: tuple[Any, Any]) -> None:
    v2, v1 = stubs
    expected = vectors(v1.Encode(epb.EncodeRequest(texts=TEXTS), timeout=WAIT))
    for raw in (True, False):
        response = v2.ModelInfer(text_request(TEXTS, raw=raw), timeout=WAIT)
        assert (response.model_name, response.model_version) == ("tiny", "1")
        assert list(response.outputs[0].shape) == [len(TEXTS), 32]
        assert np.abs(embeddings(response) - expected).max() <= 1e-5

    rows = [[2, 17, 40, 3], [2, 9, 3], [5]]
    expected = vectors(v1.Encode(epb.EncodeRequest(token_ids=[epb.TokenIds(ids=r) for r in rows]), timeout=WAIT))
    padded = [r + [0] * (4 - len(r)) for r in rows]
    mask = [[1] * len(r) + [0] * (4 - len(r)) for r in rows]
    for raw in (True, False):
        got = embeddings(v2.ModelInfer(ids_request(padded, mask, raw=raw), timeout=WAIT))
        assert np.abs(got - expected).max() <= 1e-5


def test_normalize_and_truncate_parameters(stubs: tuple[Any, Any]) -> None:
    v2, v1 = stubs
    request = text_request(["hello"])
    request.parameters["normalize"].CopyFrom(bool_param(False))
    raw = embeddings(v2.ModelInfer(request, timeout=WAIT))
    expected = vectors(v1.Encode(epb.EncodeRequest(texts=["hello"], normalize=False), timeout=WAIT))
    assert np.abs(raw - expected).max() <= 1e-6 and abs(np.linalg.norm(raw) - 1) > 1e-3

    # --auto-truncate is on by default: a long text is cut as truncate true cuts it; an explicit false refuses it
    long = text_request(["a " * 200])
    default = v2.ModelInfer(long, timeout=WAIT)
    long.parameters["truncate"].CopyFrom(bool_param(True))
    response = v2.ModelInfer(long, timeout=WAIT)
    assert response.parameters["input_tokens"].int64_param == default.parameters["input_tokens"].int64_param == MAX
    np.testing.assert_array_equal(embeddings(default), embeddings(response))
    long.parameters["truncate"].CopyFrom(bool_param(False))
    with pytest.raises(grpc.RpcError) as e:
        v2.ModelInfer(long, timeout=WAIT)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "202 tokens long" in e.value.details()


def test_request_id_and_version(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    request = text_request(["x"])
    request.id, request.model_version = "my-id-7", "1"
    response, call = stub.ModelInfer.with_call(request, metadata=(("x-request-id", "rid-9"),), timeout=WAIT)
    assert response.id == "my-id-7"
    assert ("x-request-id", "rid-9") in call.trailing_metadata()


def ok_afterwards(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    """The server keeps serving after a refused request."""
    assert embeddings(stub.ModelInfer(text_request(["still here"]), timeout=WAIT)).shape[0] == 1


def _both_contents() -> Any:
    request = text_request(["a"])
    request.inputs[0].contents.bytes_contents.append(b"a")
    return request


def _param(name: str, value: pb.InferParameter) -> Any:
    request = text_request(["a"])
    request.parameters[name].CopyFrom(value)
    return request


def _no_truncate(request: Any) -> Any:
    request.parameters["truncate"].CopyFrom(bool_param(False))  # else cut by the default --auto-truncate
    return request


def _output(name: str, class_count: int = 0) -> Any:
    request = text_request(["a"])
    output = request.outputs.add(name=name)
    if class_count:  # as tritonclient's InferRequestedOutput(name, class_count=...) sends it
        output.parameters["classification"].int64_param = class_count
    return request


def _in_shared_memory(tensor: Any, region: str, size: int) -> None:
    """As tritonclient's set_shared_memory(region, size) marks an input or a requested output."""
    tensor.parameters["shared_memory_region"].string_param = region
    tensor.parameters["shared_memory_byte_size"].int64_param = size


def _input_in_shared_memory() -> Any:
    request = pb.ModelInferRequest(model_name="tiny", inputs=[Tensor(name="text", datatype="BYTES", shape=[1])])
    _in_shared_memory(request.inputs[0], "in0", 9)
    return request


def _mask_in_shared_memory() -> Any:
    """tritonclient sends the raw contents of the other inputs only: one raw entry for two inputs."""
    request = ids_request([[2, 3]])
    del request.raw_input_contents[1]
    _in_shared_memory(request.inputs[1], "mask0", 16)
    return request


def _output_in_shared_memory() -> Any:
    request = text_request(["a"])
    _in_shared_memory(request.outputs.add(name="embeddings"), "out0", 1536)
    return request


def _no_id_rows(raw: bool, shape: tuple[int, int] = (0, 4)) -> Any:
    request = pb.ModelInferRequest(model_name="tiny")
    for name in ("input_ids", "attention_mask"):
        request.inputs.append(Tensor(name=name, datatype="INT64", shape=shape))
        if raw:
            request.raw_input_contents.append(b"")
    return request


def _retyped(request: Any, index: int, datatype: str) -> Any:
    request.inputs[index].datatype = datatype
    return request


def _reshaped(request: Any, index: int, shape: list[int]) -> Any:
    del request.inputs[index].shape[:]
    request.inputs[index].shape.extend(shape)
    return request


def _output_twice() -> Any:
    request = _output("embeddings")
    request.outputs.add(name="embeddings")
    return request


def _int_contents() -> Any:
    request = ids_request([[2, 3]], raw=False)
    request.inputs[0].contents.ClearField("int64_contents")
    request.inputs[0].contents.int_contents.extend([2, 3])
    return request


def _text_and_ids() -> Any:
    request = ids_request([[2, 3]])
    request.inputs.append(Tensor(name="text", datatype="BYTES", shape=[1]))
    request.raw_input_contents.append(pack_bytes([b"a"]))
    return request


BAD: dict[str, tuple[Callable[[], Any], str]] = {
    "no inputs": (lambda: pb.ModelInferRequest(model_name="tiny"), "missing input: set 'text'"),
    "missing attention_mask": (
        lambda: pb.ModelInferRequest(
            model_name="tiny",
            inputs=[Tensor(name="input_ids", datatype="INT64", shape=[1, 2])],
            raw_input_contents=[np.array([2, 3], dtype="<i8").tobytes()],
        ),
        "missing input 'attention_mask'",
    ),
    "unknown input": (
        lambda: pb.ModelInferRequest(model_name="tiny", inputs=[Tensor(name="INPUT0", datatype="BYTES", shape=[1])]),
        "unknown input 'INPUT0'",
    ),
    "ids as INT32": (lambda: _retyped(ids_request([[2, 3]]), 0, "INT32"), "datatype INT32; expected INT64"),
    "text as FP32": (lambda: _retyped(text_request(["a"]), 0, "FP32"), "'text' has datatype FP32; expected BYTES"),
    "raw ids shorter than the shape": (
        lambda: _reshaped(ids_request([[2, 3, 4], [2, 3, 4]]), 0, [2, 4]),
        "'input_ids' has shape [2, 4] (8 elements) but its contents hold 48 bytes (expected 64",
    ),
    "typed ids longer than the shape": (
        lambda: _reshaped(ids_request([[2, 3, 4]], raw=False), 0, [1, 2]),
        "'input_ids' has shape [1, 2] (2 elements) but its contents hold 3 values",
    ),
    "text count differs from the shape": (
        lambda: text_request(["a", "b", "c"], shape=[2]),
        "'text' has shape [2] (2 elements) but its contents hold 3 elements",
    ),
    "ids of rank 1": (lambda: _reshaped(ids_request([[2, 3]]), 0, [2]), "has shape [2]; expected [rows, tokens]"),
    "text of rank 3": (lambda: text_request(["a"], shape=[1, 1, 1]), "has shape [1, 1, 1]; expected [n] (or [n, 1])"),
    "negative dimension": (lambda: text_request([], shape=[-1]), "has shape [-1]"),
    "raw and typed both set": (_both_contents, "sets contents and the request sets raw_input_contents"),
    "raw contents per input": (
        lambda: pb.ModelInferRequest(
            model_name="tiny",
            inputs=[Tensor(name="text", datatype="BYTES", shape=[1])],
            raw_input_contents=[pack_bytes([b"a"]), pack_bytes([b"b"])],
        ),
        "2 raw_input_contents for 1 inputs",
    ),
    "raw BYTES not UTF-8": (lambda: text_request([b"ok", b"caf\xe9"]), "'text' element 1 is not UTF-8 (byte 3"),
    "typed BYTES not UTF-8": (lambda: text_request([b"\xff"], raw=False), "'text' element 0 is not UTF-8"),
    "raw BYTES cut inside a length": (
        lambda: pb.ModelInferRequest(
            model_name="tiny",
            inputs=[Tensor(name="text", datatype="BYTES", shape=[1])],
            raw_input_contents=[pack_bytes([b"a"]) + b"\x01\x00"],
        ),
        "end inside the 4-byte length of element 1",
    ),
    "raw BYTES malformed past the shape": (
        lambda: pb.ModelInferRequest(
            model_name="tiny",
            inputs=[Tensor(name="text", datatype="BYTES", shape=[1])],
            raw_input_contents=[PAST_THE_SHAPE],
        ),
        "'text' has shape [1] (1 elements) but its contents hold at least 2 elements",
    ),
    "raw BYTES element past the end": (
        lambda: pb.ModelInferRequest(
            model_name="tiny",
            inputs=[Tensor(name="text", datatype="BYTES", shape=[1])],
            raw_input_contents=[b"\x09\x00\x00\x00abc"],
        ),
        "element 0 claims 9 bytes but 3 remain",
    ),
    "INT64 values in int_contents": (_int_contents, "values go in contents.int64_contents, not contents.int_contents"),
    "mask not 0 or 1": (lambda: ids_request([[2, 3]], [[1, 2]]), "'attention_mask' holds 2"),
    "mask padding on the left": (lambda: ids_request([[0, 3]], [[0, 1]]), "row 0 is not ones then zeros"),
    "mask row of zeros": (lambda: ids_request([[2, 3], [0, 0]], [[1, 1], [0, 0]]), "row 1 is all zeros"),
    "mask of another shape": (
        lambda: _reshaped(ids_request([[2, 3, 4, 5]], [[1, 1, 1, 1]]), 1, [2, 2]),
        "'input_ids' has shape [1, 4] and 'attention_mask' has shape [2, 2]",
    ),
    "text and ids": (_text_and_ids, "set either 'text' or 'input_ids' and 'attention_mask', not both"),
    "given twice": (
        lambda: pb.ModelInferRequest(
            model_name="tiny",
            inputs=[Tensor(name="text", datatype="BYTES", shape=[1])] * 2,
            raw_input_contents=[pack_bytes([b"a"])] * 2,
        ),
        "input 'text' is given twice",
    ),
    "unknown output": (lambda: _output("logits"), "unknown output 'logits': this model has one output, 'embeddings'"),
    # asked for twice: one answered, the other dropped without a word; over gRPC refused by the count of outputs
    # (REST, which reads its outputs as it parses them, says "requested twice")
    "an output twice": (_output_twice, "2 outputs requested; the limit is 1: this model has one output, 'embeddings'"),
    "classification": (lambda: _output("embeddings", class_count=3), "asks for classification (class_count)"),
    "input in shared memory": (
        _input_in_shared_memory,
        "input 'text' sets shared_memory_region: shared memory is not supported by this server; send the data in",
    ),
    "one input in shared memory, the other raw": (
        _mask_in_shared_memory,
        "input 'attention_mask' sets shared_memory_region: shared memory is not supported by this server",
    ),
    "output in shared memory": (
        _output_in_shared_memory,
        "output 'embeddings' sets shared_memory_region: shared memory is not supported by this server",
    ),
    "no texts, raw": (lambda: text_request([], shape=[0]), "input 'text' has shape [0]: no inputs to embed"),
    "no texts, typed": (lambda: text_request([], raw=False), "input 'text' has shape [0]: no inputs to embed"),
    "no id rows, raw": (lambda: _no_id_rows(True), "input 'input_ids' has shape [0, 4]: no inputs to embed"),
    "no id rows, typed": (lambda: _no_id_rows(False), "input 'input_ids' has shape [0, 4]: no inputs to embed"),
    # No elements, but a dimension no array could have (numpy refused to shape it: an INTERNAL once).
    "no id rows of 2**62 tokens": (
        lambda: _no_id_rows(True, (0, 2**62)),
        f"input 'input_ids' has shape [0, {2**62}]: no inputs to embed",
    ),
    "id rows of no tokens": (
        lambda: _no_id_rows(True, (2, 0)),
        "input 'input_ids' has shape [2, 0]: its rows hold no tokens; every input needs at least one",
    ),
    "2**62 id rows of no tokens": (lambda: _no_id_rows(False, (2**62, 0)), f"{2**62} inputs in one request"),
    "normalize as a string": (
        lambda: _param("normalize", pb.InferParameter(string_param="false")),
        "parameter 'normalize' must be a bool (bool_param), got string_param",
    ),
    # The pipeline's own checks, the same as Encode's.
    "too many inputs": (lambda: text_request(["a"] * 9), "9 inputs in one request; the limit is 8"),
    "token id past the vocabulary": (lambda: ids_request([[2, 256]]), "token id 256, outside the vocabulary [0, 256)"),
    "ids too long without truncate": (
        lambda: _no_truncate(ids_request([[5] * (MAX + 1)])),
        f"input 0 is {MAX + 1} tokens",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_tensors_are_invalid_argument_and_the_server_goes_on(
    stub: pb_grpc.GRPCInferenceServiceStub, case: str
) -> None:
    build, message = BAD[case]
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(build(), timeout=WAIT)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert message in e.value.details()
    ok_afterwards(stub)


def _rest_text(**fields: Any) -> dict[str, Any]:
    return {"name": "text", "shape": [1], "datatype": "BYTES"} | fields


def _rest_ids(shape: list[int], ids: list[Any], mask: list[Any]) -> list[dict[str, Any]]:
    return [
        {"name": name, "shape": shape, "datatype": "INT64", "data": data}
        for name, data in (("input_ids", ids), ("attention_mask", mask))
    ]


def _rest_binary(header: dict[str, Any], binary: bytes) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(header).encode()
    return head + binary, {"inference-header-content-length": str(len(head))}


def _rest_header_length(length: str) -> tuple[bytes, dict[str, str]]:
    body, _ = _rest_binary({"inputs": [_rest_text(data=["a"])]}, b"")
    return body, {"inference-header-content-length": length}


SHM = {"shared_memory_region": "r0", "shared_memory_byte_size": 1536}
# The same checks over REST: each body (a dict sent as JSON, or bytes with their headers) and the message of its 400.
REST_BAD: dict[str, tuple[Any, str]] = {
    "input in shared memory": (
        {"inputs": [_rest_text(parameters=SHM)]},
        "input 'text' sets shared_memory_region: shared memory is not supported by this server; send the data in",
    ),
    "output in shared memory": (
        {"inputs": [_rest_text(data=["a"])], "outputs": [{"name": "embeddings", "parameters": SHM}]},
        "output 'embeddings' sets shared_memory_region: shared memory is not supported by this server",
    ),
    "data and binary data": (
        _rest_binary({"inputs": [_rest_text(data=["a"], parameters={"binary_data_size": 5})]}, pack_bytes([b"b"])),
        "input 'text' sets both 'data' and binary_data_size: use one or the other",
    ),
    "an output twice": (
        {"inputs": [_rest_text(data=["a"])], "outputs": [{"name": "embeddings"}, {"name": "embeddings"}]},
        "output 'embeddings' is requested twice",
    ),
    # orjson says "str is not valid UTF-8: surrogates not allowed ... (char 0)" of a Latin-1 byte
    "a body not UTF-8": (
        (b'{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["caf\xe9"]}]}', {}),
        "the inference request is not valid JSON: the body is not valid UTF-8 (JSON is): at byte 77, invalid",
    ),
    "header length not a number": (
        _rest_header_length("abc"),
        "Inference-Header-Content-Length is 'abc': not a byte count",
    ),
    "header length negative": (_rest_header_length("-1"), "Inference-Header-Content-Length is '-1': not a byte count"),
    # hand-written binary requests were told their JSON was broken, not what the header is for
    "binary data without the header": (
        (_rest_binary({"inputs": [_rest_text(parameters={"binary_data_size": 5})]}, pack_bytes([b"a"]))[0], {}),
        "binary tensor data after the JSON needs the Inference-Header-Content-Length header (the JSON's length in",
    ),
    "header length short of the JSON": (
        _rest_header_length(str(len(_rest_header_length("0")[0]) - 3)),
        "Inference-Header-Content-Length says the JSON is the body's first",
    ),
    # past int()'s 4,300 digits: a ValueError, answered 500
    "header length of 4,301 digits": (_rest_header_length("9" * 4301), "Inference-Header-Content-Length is '999"),
    "no texts": ({"inputs": [_rest_text(shape=[0], data=[])]}, "input 'text' has shape [0]: no inputs to embed"),
    "no id rows": ({"inputs": _rest_ids([0, 4], [], [])}, "input 'input_ids' has shape [0, 4]: no inputs to embed"),
    "no id rows of 2**62 tokens": (
        {"inputs": _rest_ids([0, 2**62], [], [])},
        f"input 'input_ids' has shape [0, {2**62}]: no inputs to embed",
    ),
    "id rows of no tokens": (
        {"inputs": _rest_ids([2, 0], [], [])},
        "input 'input_ids' has shape [2, 0]: its rows hold no tokens; every input needs at least one",
    ),
    "id past 2**64": (
        {"inputs": _rest_ids([1, 2], [[2, 2**64]], [[1, 1]])},
        "input 'input_ids' holds a value outside INT64",
    ),
    "id below -2**63": (
        {"inputs": _rest_ids([1, 2], [[2, -(2**63) - 1]], [[1, 1]])},
        "input 'input_ids' holds a value outside INT64",
    ),
    # Counted before each value's type is checked, as raw contents are counted before they are decoded.
    "binary BYTES malformed past the shape": (
        _rest_binary({"inputs": [_rest_text(parameters={"binary_data_size": len(PAST_THE_SHAPE)})]}, PAST_THE_SHAPE),
        "'text' has shape [1] (1 elements) but its contents hold at least 2 elements",
    ),
    "text of the wrong type past the shape": (
        {"inputs": [_rest_text(data=["a", 5])]},
        "'text' has shape [1] (1 elements) but its contents hold 2 elements",
    ),
    "ids of the wrong type past the shape": (
        {"inputs": _rest_ids([1, 1], [[2, "x"]], [[1]])},
        "'input_ids' has shape [1, 1] (1 elements) but its contents hold 2 values",
    ),
    "id as a fraction": (
        {"inputs": _rest_ids([1, 1], [[2.5]], [[1]])},
        "'input_ids' is INT64: its data must be integers",
    ),
}


@pytest.mark.parametrize("case", REST_BAD)
def test_bad_tensors_over_rest_are_400_with_the_same_checks(
    server: ServerThread, stub: pb_grpc.GRPCInferenceServiceStub, case: str
) -> None:
    body, message = REST_BAD[case]
    body, headers = body if isinstance(body, tuple) else (body, {})
    reply = http.request("POST", server.http_url + "/v2/models/tiny/infer", body, headers)
    assert reply.status == 400, reply.body
    assert message in reply.json()["error"]
    ok_afterwards(stub)


def test_a_null_binary_data_size_beside_data_is_unset_over_rest(server: ServerThread) -> None:
    """null is unset over REST, as for every other optional parameter: it was 400 "sets both 'data' and
    binary_data_size" for a client that writes its unset fields as null."""
    body = {"inputs": [_rest_text(data=["a"], parameters={"binary_data_size": None})]}
    reply = http.request("POST", server.http_url + "/v2/models/tiny/infer", body)
    assert reply.status == 200, reply.body
    assert reply.json()["outputs"][0]["shape"][0] == 1


def test_null_shared_memory_parameters_are_unset_over_rest(server: ServerThread) -> None:
    """null is unset over REST, as binary_data_size's is: an input or output whose shared-memory parameters a
    client wrote as null was 400 "sets shared_memory_region: shared memory is not supported". Set, even to 0,
    still refused."""
    url = server.http_url + "/v2/models/tiny/infer"
    plain = http.request("POST", url, {"inputs": [_rest_text(data=["a"])]})
    assert plain.status == 200, plain.body
    nulls = dict.fromkeys(SHARED_MEMORY)
    output = {"name": "embeddings", "parameters": nulls}
    reply = http.request("POST", url, {"inputs": [_rest_text(data=["a"], parameters=nulls)], "outputs": [output]})
    assert reply.status == 200, reply.body
    assert reply.json()["outputs"] == plain.json()["outputs"]
    for key in SHARED_MEMORY:
        for body, message in (
            ({"inputs": [_rest_text(data=["a"], parameters=nulls | {key: 0})]}, f"input 'text' sets {key}: shared"),
            (
                {"inputs": [_rest_text(data=["a"])], "outputs": [{"name": "embeddings", "parameters": {key: 0}}]},
                f"output 'embeddings' sets {key}: shared memory is not supported",
            ),
        ):
            reply = http.request("POST", url, body)
            assert reply.status == 400 and message in reply.json()["error"], (key, reply.body)


def test_null_optional_fields_are_unset_over_rest(server: ServerThread) -> None:
    """An optional field a client writes as null (id, parameters, outputs; an input's or output's parameters) is
    unset, as a null parameter is: they were 400 "Input should be a valid string" (MLServer's clients write
    them so). A required field null is refused, naming it."""
    url = server.http_url + "/v2/models/tiny/infer"
    plain = http.request("POST", url, {"inputs": [_rest_text(data=["a"])]})
    assert plain.status == 200, plain.body
    body = {
        "id": None,
        "parameters": None,
        "inputs": [_rest_text(data=["a"], parameters=None)],
        "outputs": [{"name": "embeddings", "parameters": None}],
    }
    reply = http.request("POST", url, body)
    assert reply.status == 200, reply.body
    assert reply.json()["outputs"] == plain.json()["outputs"] and "id" not in reply.json()
    reply = http.request("POST", url, {"inputs": None})
    assert reply.status == 400 and "inputs" in reply.json()["error"], reply.body


def test_a_version_in_the_name_and_in_the_path_agree_as_numbers(server: ServerThread) -> None:
    """`name:01` is `name:1` wherever a model is named: `/v2/models/tiny:1/versions/01` was refused as naming two
    versions ("ask for one"), the same version written two ways; two versions that differ still are."""
    body = {"inputs": [_rest_text(data=["a"])]}
    for path in ("tiny:1/versions/01", "tiny:01/versions/1", "tiny:1/versions/1"):
        reply = http.request("POST", f"{server.http_url}/v2/models/{path}/infer", body)
        assert reply.status == 200, (path, reply.body)
        assert reply.json()["model_version"] == "1"
    for path in ("tiny:1/versions/2", f"tiny:{'8' * 20}/versions/{'9' * 20}"):  # two past 19 digits are two
        reply = http.request("POST", f"{server.http_url}/v2/models/{path}/infer", body)
        assert reply.status == 400 and "ask for one" in reply.json()["error"], path


def test_the_unversioned_routes_take_no_version_from_the_query(server: ServerThread) -> None:
    """The protocol names a version in the path only: the unversioned routes took an undocumented
    `?model_version=` (FastAPI reads a handler's parameter not in the path from the query), listed in
    /openapi.json, and `?model_version=7` answered 404 "version '7' is not served". Now ignored, as any other
    unknown query parameter is: the latest version served answers."""
    document = http.request("GET", server.http_url + "/openapi.json").json()
    model = "/v2/models/{model_name}"
    for suffix in ("", "/ready", "/config", "/stats", "/infer"):
        for method, operation in document["paths"][model + suffix].items():
            parameters = [(p["name"], p["in"]) for p in operation.get("parameters", [])]
            assert parameters == [("model_name", "path")], (suffix, method, parameters)
        versioned = document["paths"][model + "/versions/{model_version}" + suffix]
        for operation in versioned.values():
            assert {(p["name"], p["in"]) for p in operation["parameters"]} == {
                ("model_name", "path"),
                ("model_version", "path"),
            }
    models = server.http_url + "/v2/models/tiny"
    body = {"inputs": [_rest_text(data=["a"])]}
    for query in ("?model_version=7", "?model_version=1", "?other=7"):
        reply = http.request("POST", f"{models}/infer{query}", body)
        assert reply.status == 200 and reply.json()["model_version"] == "1", (query, reply.body)
        assert http.request("GET", f"{models}/ready{query}").status == 200, query
        for suffix in ("", "/config", "/stats"):
            reply = http.request("GET", f"{models}{suffix}{query}")
            assert reply.status == 200, (suffix, query, reply.body)
    assert http.request("POST", f"{models}/versions/7/infer", body).status == 404  # in the path, still a version


def test_repository_routes_read_json_whatever_the_content_type(start: Start, settings: Settings) -> None:
    """tritonclient declares no Content-Type, `curl -d` a form's: the repository routes read JSON as /infer does."""
    srv = start(dataclasses.replace(settings, model_control="explicit", http_port=free_port()))
    repository = srv.http_url + "/v2/repository"

    def post(path: str, body: bytes, content_type: str) -> http.Reply:
        return http.request("POST", repository + path, body, {"content-type": content_type})

    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        reply = post("/index", b'{"ready": true}', content_type)
        assert reply.status == 200, reply.body
        assert [(e["name"], e["state"]) for e in reply.json()] == [("tiny", "READY")]
        assert post("/models/tiny/unload", b"{}", content_type).status == 200
        assert post("/models/tiny/load", b'{"parameters": {}}', content_type).status == 200
        # read, not skipped: a load's parameters are refused, whatever the content type
        reply = post("/models/tiny/load", b'{"parameters": {"config": "{}"}}', content_type)
        assert reply.status == 400 and "load parameters are not supported" in reply.json()["error"]
        # null is unset, the parameters as a parameter
        for body in (b'{"parameters": null}', b'{"parameters": {"config": null}}'):
            assert post("/models/tiny/load", body, content_type).status == 200, body
        assert post("/index", b'{"ready": null}', content_type).status == 200
        reply = post("/index", b"ready=true", content_type)
        assert reply.status == 400 and "not valid JSON" in reply.json()["error"]


def test_too_many_inputs_are_refused_by_their_shape_or_count_before_they_are_decoded(
    server: ServerThread, stubs: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every protocol counts a request's inputs before decoding them, which costs per input on the event loop:
    500,000 token-id lists in encoder.v1 (a 4 MB message) took 2.5 s to become arrays, and then were refused;
    KServe's tensors are counted by their declared shape. Each refusal is in the model's statistics."""
    from mhaserve.service import encoder_v1
    from mhaserve.service.kserve import rest, servicer

    decoded: list[str] = []

    def spy(module: Any, name: str) -> None:
        real = getattr(module, name)

        def decode(*args: Any) -> Any:
            decoded.append(module.__name__)
            return real(*args)

        monkeypatch.setattr(module, name, decode)

    for module, name in ((encoder_v1, "from_pb"), (servicer, "from_pb"), (rest, "from_request")):
        spy(module, name)
    v2, v1 = stubs
    nine = [[2, 5, 3]] * 9
    fails = v2.ModelStatistics(pb.ModelStatisticsRequest(name="tiny"), timeout=WAIT).model_stats[0]
    before = fails.inference_stats.fail.count
    calls: list[Callable[[], Any]] = [
        lambda: v1.Encode(epb.EncodeRequest(token_ids=[epb.TokenIds(ids=r) for r in nine]), timeout=WAIT),
        lambda: next(iter(v1.EncodeStream(iter([epb.EncodeRequest(texts=["a"] * 9)]), timeout=WAIT))),
        lambda: v2.ModelInfer(ids_request(nine), timeout=WAIT),
        lambda: v2.ModelInfer(text_request(["a"] * 9, raw=False), timeout=WAIT),
    ]
    for call in calls:
        try:
            reply = call()
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "9 inputs in one request" in str(e.details())
        else:  # EncodeStream answers a failed request in its stream
            assert "9 inputs in one request" in reply.error.message
    ids = [{"name": n, "datatype": "INT64", "shape": [9, 3], "data": nine} for n in ("input_ids", "attention_mask")]
    reply = http.request("POST", server.http_url + "/v2/models/tiny/infer", {"inputs": ids})
    assert reply.status == 400 and "9 inputs in one request" in reply.json()["error"]
    assert decoded == []
    after = v2.ModelStatistics(pb.ModelStatisticsRequest(name="tiny"), timeout=WAIT).model_stats[0]
    assert after.inference_stats.fail.count == before + 5
    ok_afterwards(v2)
    assert (
        len(v1.Encode(epb.EncodeRequest(token_ids=[epb.TokenIds(ids=r) for r in nine[:8]]), timeout=WAIT).embeddings)
        == 8
    )
    assert decoded == ["mhaserve.service.kserve.servicer", "mhaserve.service.encoder_v1"]  # within the limit


def test_a_bytes_tensor_of_a_million_elements_for_one_is_refused_by_its_count_over_grpc_and_rest(
    server: ServerThread, stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    """Its shape declares one input, so the pipeline's count lets it through; the tensor's own count refuses it,
    now after reading two of its elements rather than all of them (1.25 s of the event loop)."""
    raw = pack_bytes([b""] * 1_000_000)  # 4 MB: within the message and body limits
    message = "input 'text' has shape [1] (1 elements) but its contents hold at least 2 elements"
    request = pb.ModelInferRequest(
        model_name="tiny", inputs=[Tensor(name="text", datatype="BYTES", shape=[1])], raw_input_contents=[raw]
    )
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(request, timeout=WAIT)
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    body, headers = _rest_binary({"inputs": [_rest_text(parameters={"binary_data_size": len(raw)})]}, raw)
    reply = http.request("POST", server.http_url + "/v2/models/tiny/infer", body, headers)
    assert (reply.status, reply.json()) == (400, {"error": message})
    ok_afterwards(stub)


def test_more_outputs_or_input_tensors_than_the_model_has_are_refused_by_their_count_over_grpc(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    """A 4 MB request of one text and 2,000,000 empty outputs (or input tensors) held the event loop for seconds,
    health checks waiting, while every entry was read (an output's parameters, an input's name and shape), and
    was then refused for its first one ("unknown output ''"). Their number is refused first, without reading any,
    in ModelInfer and in ModelStreamInfer."""
    many_outputs = text_request(["a"])
    many_outputs.outputs.extend([pb.ModelInferRequest.InferRequestedOutputTensor()] * 100_000)
    many_inputs = text_request(["a"])
    many_inputs.inputs.extend([Tensor()] * 100_000)
    cases = [
        (many_outputs, "100000 outputs requested; the limit is 1: this model has one output, 'embeddings'"),
        (
            many_inputs,
            "100001 input tensors in one request; the limit is 3: this model takes 'text' (BYTES [-1]) or "
            "'input_ids' and 'attention_mask' (INT64 [-1, -1])",
        ),
    ]
    for request, message in cases:
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request, timeout=WAIT)
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    responses = list(stub.ModelStreamInfer(iter([r for r, _ in cases] + [text_request(["b"])]), timeout=WAIT))
    assert [r.error_message for r in responses] == [f"INVALID_ARGUMENT: {m}" for _, m in cases] + [""]
    ok_afterwards(stub)


def test_unknown_models_and_versions_are_not_found(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    def other(model: str = "tiny", version: str = "") -> list[tuple[Callable[..., Any], Any]]:
        infer = text_request(["a"])
        infer.model_name, infer.model_version = model, version
        return [
            (stub.ModelInfer, infer),
            (stub.ModelMetadata, pb.ModelMetadataRequest(name=model, version=version)),
            (stub.ModelConfig, pb.ModelConfigRequest(name=model, version=version)),
            (stub.ModelStatistics, pb.ModelStatisticsRequest(name=model, version=version)),
        ]

    # a version past Python's 4,300 digits for int(): ValueError, answered INTERNAL (UNKNOWN for ModelReady)
    huge = "9" * 4301
    for (call, request), message in (
        [(c, "'nope' is not served here") for c in other("nope")]
        + [(c, "version '2' is not served here (serving version 1)") for c in other(version="2")]
        + [(c, "version '99999") for c in other(version=huge)]
    ):
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert message in e.value.details()
    ok_afterwards(stub)


def test_a_call_that_names_no_model_is_refused_not_given_the_default(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    """KServe v2 names the model in every call (REST has it in the path): a client that forgot it got the
    default model's embeddings, as Triton does not. ModelStatistics with no name is every model's (Triton's)."""
    infer = text_request(["a"])
    infer.model_name = ""
    for call, request in (
        (stub.ModelInfer, infer),
        (stub.ModelMetadata, pb.ModelMetadataRequest(name="")),
        (stub.ModelConfig, pb.ModelConfigRequest(name="", version="1")),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no model named" in (e.value.details() or "")
    stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name=""), timeout=WAIT)
    assert [s.name for s in stats.model_stats] == ["tiny"]
    ok_afterwards(stub)


def test_model_ready_answers_for_the_served_model_and_version_only(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    def ready(name: str, version: str = "") -> bool:
        return bool(stub.ModelReady(pb.ModelReadyRequest(name=name, version=version), timeout=WAIT).ready)

    assert ready("tiny") and ready("tiny", "1")
    assert not ready("")  # KServe names the model in every call: no name is no model, not the default
    assert not ready("nope") and not ready("tiny", "2") and not ready("tiny", "latest")
    assert not ready("tiny", "9" * 4301)  # past int()'s 4,300 digits: UNKNOWN "Unexpected error" once
    assert stub.ServerLive(pb.ServerLiveRequest(), timeout=WAIT).live
    assert stub.ServerReady(pb.ServerReadyRequest(), timeout=WAIT).ready


def test_metadata_and_config(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    server = stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=WAIT)
    assert server.name == "mhaserve" and server.version
    assert set(server.extensions) == {
        "model_configuration",
        "parameters",
        "statistics",
        "model_repository",
        "binary_tensor_data",
    }

    meta = stub.ModelMetadata(pb.ModelMetadataRequest(name="tiny"), timeout=WAIT)
    assert (meta.name, list(meta.versions), meta.platform) == ("tiny", ["1"], "onnxruntime_onnx")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("text", "BYTES", [-1]),
        ("input_ids", "INT64", [-1, -1]),
        ("attention_mask", "INT64", [-1, -1]),
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("embeddings", "FP32", [-1, 32])]

    config = stub.ModelConfig(pb.ModelConfigRequest(name="tiny", version="1"), timeout=WAIT).config
    assert (config.name, config.max_batch_size, config.version_policy.latest.num_versions) == ("tiny", 8, 1)
    assert [(i.name, i.data_type, list(i.dims), i.optional) for i in config.input] == [
        ("text", mc.TYPE_STRING, [], True),
        ("input_ids", mc.TYPE_INT64, [-1], True),
        ("attention_mask", mc.TYPE_INT64, [-1], True),
    ]
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [("embeddings", mc.TYPE_FP32, [32])]
    assert config.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 8192
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert config.default_model_filename == "model.optimized-cpu.onnx"
    assert config.parameters["max_batch_tokens"].string_value == "256"


def test_stream_answers_in_order_and_survives_bad_requests(server: ServerThread, stubs: tuple[Any, Any]) -> None:
    v2, v1 = stubs
    codes, method = ("OK", "INVALID_ARGUMENT", "NOT_FOUND"), "inference.GRPCInferenceService/ModelStreamInfer"
    before = {c: server.samples().get("mhaserve_stream_responses_total", method=method, code=c) for c in codes}
    requests = [text_request([t]) for t in ("first", "second", "third")]
    requests.insert(1, text_request([b"\xff"]))  # not UTF-8: an error response, the stream goes on
    unknown = text_request(["x"])
    unknown.model_name = "nope"
    requests.insert(3, unknown)
    for i, r in enumerate(requests):
        r.id = f"r{i}"
    responses = list(v2.ModelStreamInfer(iter(requests), timeout=WAIT))
    assert [r.infer_response.id for r in responses] == [f"r{i}" for i in range(5)]
    assert responses[1].error_message.startswith("INVALID_ARGUMENT: input 'text' element 0 is not UTF-8")
    assert responses[3].error_message.startswith("NOT_FOUND: model 'nope' is not served here")
    # Each answer, an error's too, is its request's last, as Triton marks every one of a model that is not
    # decoupled (clients read a stream until they see it: PyTriton's waited for ever without it).
    assert [r.infer_response.parameters["triton_final_response"].bool_param for r in responses] == [True] * 5
    after = {c: server.samples().get("mhaserve_stream_responses_total", method=method, code=c) for c in codes}
    assert {c: after[c] - before[c] for c in codes} == {"OK": 3, "INVALID_ARGUMENT": 1, "NOT_FOUND": 1}
    expected = vectors(v1.Encode(epb.EncodeRequest(texts=["first", "second", "third"]), timeout=WAIT))
    got = np.concatenate([embeddings(responses[i].infer_response) for i in (0, 2, 4)])
    assert not any(responses[i].error_message for i in (0, 2, 4))
    assert np.abs(got - expected).max() <= 1e-5


def test_reflection_lists_the_v2_service(server: ServerThread) -> None:
    with server.channel() as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
        ]
        listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=WAIT))
    assert SERVICE in {s.name for s in listed.list_services_response.service}
    files = [FileDescriptorProto.FromString(b) for b in described.file_descriptor_response.file_descriptor_proto]
    service = next(f for f in files if f.service)
    assert service.package == "inference"
    assert {m.name for m in service.service[0].method} >= {"ModelInfer", "ModelStreamInfer", "ModelConfig"}


def counted(srv: ServerThread, code: str) -> float:
    value = srv.server.metrics.registry.get_sample_value("mhaserve_requests_total", {"method": INFER, "code": code})
    return value or 0.0


def test_both_apis_share_the_batcher_statistics_and_metrics(start: Start, settings: Settings) -> None:
    engine = ScriptedEngine(hang_on=99)
    srv = start(dataclasses.replace(settings, max_wait_ms=0.0, http_port=free_port()), engine.factory())
    try:
        with srv.channel() as channel:
            v2, v1 = pb_grpc.GRPCInferenceServiceStub(channel), epb_grpc.EncoderServiceStub(channel)
            held = v1.Encode.future(epb.EncodeRequest(token_ids=[epb.TokenIds(ids=[99])]), timeout=WAIT)
            assert engine.hanging.wait(WAIT)
            by_v2 = v2.ModelInfer.future(ids_request([[5, 6, 0]], [[1, 1, 0]]), timeout=WAIT)
            by_v1 = v1.Encode.future(epb.EncodeRequest(token_ids=[epb.TokenIds(ids=[7, 8])]), timeout=WAIT)
            wait_until(lambda: srv.depth() == 2, "one request of each API queued behind the held batch")
            engine.release.set()
            held.result(timeout=WAIT)
            by_v1.result(timeout=WAIT)
            assert embeddings(by_v2.result(timeout=WAIT)).shape == (1, 4)
            assert sorted(engine.batches[-1]) == [[5, 6], [7, 8]]  # one batch, padding stripped
            with pytest.raises(grpc.RpcError):
                v2.ModelInfer(ids_request([[5]], [[2]]), timeout=WAIT)
            # refused at the REST adapter's boundary too (a mask that is not 0/1): failed for the model
            mask = {"name": "attention_mask", "datatype": "INT64", "shape": [1, 1], "data": [2]}
            ids = {"name": "input_ids", "datatype": "INT64", "shape": [1, 1], "data": [5]}
            reply = http.request("POST", srv.http_url + "/v2/models/tiny/infer", {"inputs": [ids, mask]})
            assert reply.status == 400, reply.body

            stats = v2.ModelStatistics(pb.ModelStatisticsRequest(), timeout=WAIT)
            rest = http.request("GET", srv.http_url + "/v2/models/tiny/stats").json()
    finally:
        engine.release.set()
    (model,) = stats.model_stats
    s = model.inference_stats
    assert (model.name, model.version) == ("tiny", "1")
    assert (s.success.count, s.fail.count, model.inference_count) == (3, 2, 3)  # both APIs
    assert model.execution_count == 2  # batches: [99], then [5, 6] + [7, 8]
    # per successful request, as Triton counts them: a batch's time in the model counts for each of its requests
    assert s.queue.count == s.compute_input.count == s.compute_infer.count == s.compute_output.count == 3
    assert all(d.ns > 0 for d in (s.success, s.fail, s.queue, s.compute_input, s.compute_infer, s.compute_output))
    parts = s.queue.ns + s.compute_input.ns + s.compute_infer.ns + s.compute_output.ns
    assert parts <= s.success.ns  # each request's parts lie within its whole
    assert model.last_inference > 0
    # No response cache: Triton's cache_hit and cache_miss, which it always reports (perf_analyzer reads them),
    # are zeros, over REST as over gRPC
    assert s.HasField("cache_hit") and s.HasField("cache_miss")
    (rest_model,) = rest["model_stats"]
    assert {k: rest_model["inference_stats"][k] for k in ("cache_hit", "cache_miss")} == dict.fromkeys(
        ("cache_hit", "cache_miss"), {"count": 0, "ns": 0}
    )
    wait_until(lambda: counted(srv, "OK") == 1 and counted(srv, "INVALID_ARGUMENT") == 1, "ModelInfer counted")
    # each model's requests by status agree with its statistics (the refusals at decode once missed there)
    samples = srv.samples()
    by_code = {
        c: samples.get("mhaserve_model_requests_total", model="tiny", code=c) for c in ("OK", "INVALID_ARGUMENT")
    }
    assert by_code == {"OK": 3, "INVALID_ARGUMENT": 2}


def test_health_follows_loading_and_draining(start: Start, settings: Settings) -> None:
    loaded = threading.Event()
    engine = ScriptedEngine()

    def slow_factory(entry: Any) -> ScriptedEngine:
        assert loaded.wait(WAIT)
        return engine

    srv = start(settings, slow_factory, ready=False)
    try:
        with srv.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)

            def state() -> tuple[bool, bool, bool, str]:
                reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=WAIT)
                return (
                    stub.ServerLive(pb.ServerLiveRequest(), timeout=WAIT).live,
                    stub.ServerReady(pb.ServerReadyRequest(), timeout=WAIT).ready,
                    stub.ModelReady(pb.ModelReadyRequest(name="tiny"), timeout=WAIT).ready,
                    health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status),
                )

            def refused() -> str:
                with pytest.raises(grpc.RpcError) as e:
                    stub.ModelInfer(text_request(["a"]), timeout=WAIT)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                return e.value.details()

            assert state() == (True, False, False, "NOT_SERVING")
            assert "still loading" in refused()
            loaded.set()
            srv.ready()
            assert state() == (True, True, True, "SERVING")
            ok_afterwards(stub)
            srv.call(srv.server.drain())
            assert state() == (True, False, False, "NOT_SERVING")
            assert "shutting down" in refused()
    finally:
        loaded.set()


# ---- arbitrary requests ------------------------------------------------------------------------------------

_INT64 = st.integers(-(2**63), 2**63 - 1)
_PARAMETER = st.one_of(
    st.builds(pb.InferParameter, bool_param=st.booleans()),
    st.builds(pb.InferParameter, int64_param=_INT64),
    st.builds(pb.InferParameter, string_param=st.text(max_size=8)),
    st.builds(pb.InferParameter, double_param=st.floats()),
    st.builds(pb.InferParameter, uint64_param=st.integers(0, 2**64 - 1)),
)
_PARAMETERS = st.dictionaries(
    st.sampled_from(["binary_data", "normalize", "truncate", "dimensions", "prompt_name", "x", ""]),
    _PARAMETER,
    max_size=3,
)
_CONTENTS = st.one_of(
    st.builds(pb.InferTensorContents),
    st.builds(pb.InferTensorContents, bytes_contents=st.lists(st.binary(max_size=12), max_size=5)),
    st.builds(pb.InferTensorContents, int64_contents=st.lists(_INT64, max_size=8)),
    st.builds(pb.InferTensorContents, int_contents=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8)),
    st.builds(pb.InferTensorContents, fp32_contents=st.lists(st.floats(width=32), max_size=8)),
    st.builds(pb.InferTensorContents, bool_contents=st.lists(st.booleans(), max_size=8)),
    st.builds(pb.InferTensorContents, uint64_contents=st.lists(st.integers(0, 2**64 - 1), max_size=8)),
)
_TENSOR = st.builds(
    Tensor,
    name=st.sampled_from(["text", "input_ids", "attention_mask", "token_type_ids", "x", ""]),
    datatype=st.sampled_from(["BYTES", "INT64", "INT32", "FP32", "BOOL", "UINT64", "FP16", "bytes", ""]),
    shape=st.lists(st.sampled_from([-1, 0, 1, 2, 3, 5, MAX + 1, 2**31, 2**62]), max_size=3),
    parameters=_PARAMETERS,
    contents=_CONTENTS,
)


@hsettings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    inputs=st.lists(_TENSOR, max_size=3),
    raw=st.none() | st.lists(st.binary(max_size=48), max_size=3),
    outputs=st.lists(st.sampled_from(["embeddings", "x", ""]), max_size=2),
    parameters=_PARAMETERS,
    version=st.sampled_from(["", "1", "2", "0", "-1", "01", "x"]),
)
def test_arbitrary_infer_requests_are_answered_or_refused_never_failed(
    stub: pb_grpc.GRPCInferenceServiceStub,
    inputs: list[Any],
    raw: list[bytes] | None,
    outputs: list[str],
    parameters: dict[str, Any],
    version: str,
) -> None:
    """Any tensors (names, datatypes, shapes, contents of any field or raw), parameters, outputs and version:
    the call is answered, or refused with a status that says what was wrong with it; never INTERNAL or
    UNKNOWN (an error of ours), and the server serves on."""
    request = pb.ModelInferRequest(
        model_name="tiny",
        model_version=version,
        inputs=inputs,
        parameters=parameters,
        outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name=n) for n in outputs],
    )
    if raw is not None:
        request.raw_input_contents.extend(raw)
    try:
        stub.ModelInfer(request, timeout=WAIT)
    except grpc.RpcError as e:
        assert e.code() in REFUSALS, (e.code(), e.details(), request)
