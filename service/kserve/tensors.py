"""The model as the Open Inference Protocol sees it, and the checks on its tensors, whatever the wire.

- inputs: `text` BYTES [-1] (UTF-8, tokenised by the server), or `input_ids` and `attention_mask`
  INT64 [-1, -1] (rows padded on the right; the mask strips the padding so the batcher can re-pack
  the rows with other requests');
- output: `embeddings` FP32 [-1, dim];
- request parameters (an mhaserve extension): `normalize` and `truncate`, both bools, `prompt_name`, a
  string, and `dimensions`, an integer, as in encoder.v1's EncodeRequest (an unset `truncate` is the server's
  --auto-truncate, a false one refuses a long input: a parameter, unlike a proto3 bool, can be absent); the
  response carries `input_tokens`.

The gRPC codec (codec.py) and the REST one (rest.py) only take each input's name, datatype, shape and
contents (raw bytes, or the wire's typed values) and each parameter off their wire; everything from there
on is here, once, so that the two wires cannot come to disagree.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from mhaserve.runtime.errors import InvalidArgument
from mhaserve.service.pipeline import EncodeInput

TEXT, IDS, MASK, OUTPUT = "text", "input_ids", "attention_mask", "embeddings"
INPUT_TYPES = {TEXT: "BYTES", IDS: "INT64", MASK: "INT64"}
EXPECTED_INPUTS = f"{TEXT!r} (BYTES [-1]) or {IDS!r} and {MASK!r} (INT64 [-1, -1])"
TEXT_SHAPES: list[tuple[int | None, ...]] = [(None,), (None, 1)]  # [n], or [n, 1] as Triton's examples send it
IDS_SHAPES: list[tuple[int | None, ...]] = [(None, None)]
# Triton's shared-memory extensions (system and CUDA): a tensor whose parameters name a region registered with
# the server. Not implemented here (the server metadata does not list them), so such a tensor is refused: an
# output answered inline would leave the client reading stale data from its region, and an input's data is
# not in the request at all.
SHARED_MEMORY = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


def check_shape(name: str, shape: Sequence[int], forms: Sequence[tuple[int | None, ...]], expected: str) -> int:
    """Check a tensor's shape against the allowed forms (None: any size) and return its element count."""
    shape = list(shape)
    fits = any(
        len(shape) == len(form) and all(want is None or want == got for want, got in zip(form, shape, strict=True))
        for form in forms
    )
    if not fits or any(d < 0 for d in shape):
        raise InvalidArgument(f"input {name!r} has shape {shape}; expected {expected}")
    n = 1
    for d in shape:
        n *= d
    return n


def declared_inputs(shapes: Mapping[str, Sequence[int]]) -> int | None:
    """How many inputs a request's tensors declare (the first dimension of `text`, else of `input_ids`), read
    from their shapes before any data is decoded; None where no shape says."""
    shape = shapes.get(TEXT, shapes.get(IDS))
    if not shape or not isinstance(shape[0], int) or shape[0] < 0:
        return None
    return shape[0]


def outside_int64(name: str) -> InvalidArgument:
    return InvalidArgument(f"input {name!r} holds a value outside INT64")


def no_inputs(name: str, shape: Sequence[int]) -> InvalidArgument:
    # In KServe's terms: the pipeline's own message names encoder.v1's fields (texts, token_ids).
    return InvalidArgument(f"input {name!r} has shape {list(shape)}: no inputs to embed; send at least one")


def count_error(name: str, shape: Sequence[int], elements: int, given: str) -> InvalidArgument:
    return InvalidArgument(
        f"input {name!r} has shape {list(shape)} ({elements} elements) but its contents hold {given}"
    )


# What a count of a tensor's elements (typed contents or JSON data) calls them, by datatype.
COUNTED_AS = {"BYTES": "elements", "INT64": "values"}


def check_count(name: str, shape: Sequence[int], given: int, datatype: str) -> None:
    """The number of elements given (typed contents, or JSON data) against the number the shape declares."""
    elements = math.prod(shape)
    if given != elements:
        raise count_error(name, shape, elements, f"{given} {COUNTED_AS[datatype]}")


def unpack_bytes(raw: bytes, name: str, shape: Sequence[int]) -> list[bytes]:
    """Triton's BYTES serialisation of a tensor of `shape`: each element a 4-byte little-endian length, then
    that many bytes.

    Contents that go on past one element more than the shape declares are refused by their count there, the
    rest unread: a million empty elements for a shape of [1] took 1.25 s of the event loop to unpack, and were
    then refused all the same."""
    elements = math.prod(shape)
    out: list[bytes] = []
    pos, view = 0, memoryview(raw)
    while pos < len(raw):
        if len(out) > elements:
            raise count_error(name, shape, elements, f"at least {len(out)} elements")
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


def decode_texts(name: str, items: Sequence[bytes | str]) -> list[str]:
    """BYTES elements as text; INVALID_ARGUMENT naming the element and byte that is not UTF-8. JSON's
    elements are strings already and pass as they are."""
    texts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            texts.append(item)
            continue
        try:
            texts.append(item.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InvalidArgument(
                f"input {name!r} element {i} is not UTF-8 (byte {e.start}: {item[e.start : e.start + 1]!r}); "
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


def check_shared_memory(kind: str, name: str, parameters: Mapping[str, Any]) -> None:
    """An input's or output's parameters: none may name a shared-memory region (SHARED_MEMORY). A null one is
    unset, as every REST parameter is (clients write the optional fields they leave unset as null)."""
    named = [key for key in SHARED_MEMORY if parameters.get(key) is not None]
    if named:
        where = "send the data in the request" if kind == "input" else "read the output from the response"
        raise InvalidArgument(
            f"{kind} {name!r} sets {named[0]}: shared memory is not supported by this server; {where}"
        )


def check_outputs(outputs: Sequence[tuple[str, Mapping[str, Any], bool]]) -> None:
    """The requested outputs: each one's name, its parameters, and whether it asks for Triton's
    classification extension (`class_count` in tritonclient), which an embedding has no classes for: refused
    rather than answered with the embeddings the client did not ask for."""
    seen: set[str] = set()
    for name, parameters, classification in outputs:
        if name != OUTPUT:
            raise InvalidArgument(f"unknown output {name!r}: this model has one output, {OUTPUT!r}")
        if name in seen:  # the asks may differ (JSON, binary): one answered, the other dropped without a word
            raise InvalidArgument(f"output {name!r} is requested twice")
        seen.add(name)
        check_shared_memory("output", name, parameters)
        if classification:
            raise InvalidArgument(
                f"output {name!r} asks for classification (class_count); this server returns embeddings, not classes"
            )


def check_input(name: str, datatype: str, parameters: Mapping[str, Any], seen: Container[str]) -> None:
    """An input's name, datatype and parameters, before its contents are read."""
    if name not in INPUT_TYPES:
        raise InvalidArgument(f"unknown input {name!r}: this model takes {EXPECTED_INPUTS}")
    if name in seen:
        raise InvalidArgument(f"input {name!r} is given twice")
    if datatype != INPUT_TYPES[name]:
        raise InvalidArgument(f"input {name!r} has datatype {datatype or '(none)'}; expected {INPUT_TYPES[name]}")
    check_shared_memory("input", name, parameters)


@dataclass(frozen=True)
class Tensor:
    """An input as its wire holds it, decoded only once it is used (by `texts` or `int64`): its raw bytes
    (gRPC's raw_input_contents, REST's binary tensor data) or, without them, `values()`: the typed contents
    or the JSON data, which the wire reads and checks the types of in its own terms."""

    name: str
    shape: Sequence[int]
    raw: bytes | None
    values: Callable[[], Sequence[Any]]


def texts(tensor: Tensor) -> list[str]:
    """A `text` input: one UTF-8 string per element of its shape."""
    check_shape(tensor.name, tensor.shape, TEXT_SHAPES, "[n] (or [n, 1])")
    items = unpack_bytes(tensor.raw, tensor.name, tensor.shape) if tensor.raw is not None else tensor.values()
    # Counted before decoding: a tensor of the wrong size is refused without reading its text.
    check_count(tensor.name, tensor.shape, len(items), "BYTES")
    return decode_texts(tensor.name, items)


def int64(tensor: Tensor) -> npt.NDArray[np.int64]:
    """An `input_ids` or `attention_mask` input: an int64 array of its shape."""
    n = check_shape(tensor.name, tensor.shape, IDS_SHAPES, "[rows, tokens]")
    if not n:
        # Refused before any array is shaped: with no elements the other dimension can be any size, one numpy
        # cannot shape ([0, 2**62]) or rows too many to strip one by one ([2**40, 0]).
        if not tensor.shape[0]:
            raise no_inputs(tensor.name, tensor.shape)
        raise InvalidArgument(
            f"input {tensor.name!r} has shape {list(tensor.shape)}: its rows hold no tokens; every input needs at "
            "least one"
        )
    if tensor.raw is not None:
        if len(tensor.raw) != 8 * n:
            raise count_error(tensor.name, tensor.shape, n, f"{len(tensor.raw)} bytes (expected {8 * n}: 8 per INT64)")
        values = np.frombuffer(tensor.raw, dtype="<i8")
    else:
        flat = tensor.values()
        check_count(tensor.name, tensor.shape, len(flat), "INT64")
        try:
            values = np.asarray(flat, dtype=np.int64)
        except OverflowError:  # JSON integers are unbounded; gRPC's int64_contents cannot overflow
            raise outside_int64(tensor.name) from None
    # copy=False: a large raw tensor is not copied again (its array stays read-only, as frombuffer made it).
    return values.astype(np.int64, copy=False).reshape(tuple(tensor.shape))


ParamT = TypeVar("ParamT", bool, str, int)  # the types of the request parameters read
PARAMETER_TYPES: dict[type, str] = {bool: "a bool", str: "a string", int: "an integer"}  # as errors name them


class ParameterReader(Protocol):
    """A wire's `read(key, type)`: the value of a request parameter, None when it is not set; a value of
    another type is refused in the wire's own terms (a protobuf oneof, a JSON type)."""

    def __call__(self, key: str, want: type[ParamT], /) -> ParamT | None: ...


@dataclass(frozen=True)
class Options:
    """The request parameters that shape the answer; any other parameter is ignored, as Triton does."""

    truncate: bool | None = None  # None: the server's --auto-truncate
    normalize: bool | None = None  # None: the model's default
    prompt_name: str | None = None  # None (or ""): the model's default prompt
    dimensions: int | None = None  # None: every dimension; else the leading ones (the pipeline checks and cuts)


def request_options(read: ParameterReader) -> Options:
    """The options from the request parameters, as the wire reads them."""
    # Read in this order: of several bad parameters, the first named here is the one reported.
    normalize, truncate = read("normalize", bool), read("truncate", bool)
    prompt_name, dimensions = read("prompt_name", str) or None, read("dimensions", int)
    return Options(truncate=truncate, normalize=normalize, prompt_name=prompt_name, dimensions=dimensions)


def encode_input(inputs: Mapping[str, Tensor], options: Options, *, model: str, version: str | None) -> EncodeInput:
    """The internal request from the inputs given, each decoded only if it is used: `text`, or
    `input_ids` and `attention_mask` (of one shape)."""
    common: dict[str, Any] = {
        "model": model,
        "version": version,
        "truncate": options.truncate,
        "normalize": options.normalize,
        "prompt_name": options.prompt_name,
        "dimensions": options.dimensions,
    }
    if TEXT in inputs:
        if IDS in inputs or MASK in inputs:
            raise InvalidArgument(f"set either {TEXT!r} or {IDS!r} and {MASK!r}, not both")
        given = texts(inputs[TEXT])
        if not given:
            raise no_inputs(TEXT, inputs[TEXT].shape)
        return EncodeInput(texts=given, **common)
    missing = [name for name in (IDS, MASK) if name not in inputs]
    if len(missing) == 2:
        raise InvalidArgument(f"missing input: set {EXPECTED_INPUTS}")
    if missing:
        raise InvalidArgument(f"missing input {missing[0]!r}: {IDS!r} and {MASK!r} go together")
    ids, mask = int64(inputs[IDS]), int64(inputs[MASK])
    if ids.shape != mask.shape:
        raise InvalidArgument(
            f"{IDS!r} has shape {list(ids.shape)} and {MASK!r} has shape {list(mask.shape)}: they must be the same"
        )
    if not len(ids):
        raise no_inputs(IDS, ids.shape)
    return EncodeInput(token_ids=strip_padding(ids, mask), **common)
