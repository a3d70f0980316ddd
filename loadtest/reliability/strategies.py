"""Hypothesis strategies for every request field of both APIs, from plausible to hostile.

Each strategy mixes three kinds of value: valid ones (so requests get past the first check and into the
deeper ones), edge values (empty, one past a limit, int64's extremes, NUL, BOM, bidi overrides) and
noise (random unicode with control characters, random bytes, huge strings and lists). Large arrays
come from a numpy generator seeded by hypothesis, so drawing them stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.inference.v2 import grpc_service_pb2 as kpb
from mhaserve.service.kserve.tensors import pack_bytes

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
PRINTABLE_ASCII = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
# Names that would walk out of a model repository if one were ever joined to a path.
HOSTILE_NAMES = (
    "..",
    "../x",
    "/etc/passwd",
    "x/../../y",
    "\x00",
    "a\x00b",
    "\u2024\u2024/x",
    "\uff0e\uff0e/",
    "%2e%2e",
)


@dataclass(frozen=True)
class Model:
    """What the strategies need to know about the served model."""

    name: str
    vocab_size: int
    max_tokens: int
    max_inputs: int  # max_client_batch_size


def texts() -> st.SearchStrategy[str]:
    common = st.one_of(
        st.text(max_size=120),  # any code point but surrogates: control characters included
        st.text(st.characters(categories=["Cc", "Cf", "Zs", "Zl", "Zp", "Mn", "Co"]), max_size=60),
        st.sampled_from(["", " ", "\x00", "\x00" * 500, "\ufeff", "\u202e abc", "🤖" * 300, "a " * 400, "\r\n" * 50]),
    )
    # huge, one text in twenty: past the model's length (truncate or INVALID_ARGUMENT), past the message limit
    huge = st.sampled_from([20_000, 300_000, 5_000_000]).map(lambda n: "word " * (n // 5))
    return st.integers(0, 19).flatmap(lambda k: huge if k == 0 else common)


def names(model: Model) -> st.SearchStrategy[str]:
    """The served model's name (or empty, the default) seven times in ten, so requests get past it."""
    other = st.one_of(
        st.sampled_from(HOSTILE_NAMES),
        st.text(max_size=40),
        st.just(model.name.upper()),
        st.integers(1000, 100_000).map(lambda n: "m" * n),
    )
    return st.integers(0, 9).flatmap(lambda k: st.sampled_from(["", model.name]) if k < 7 else other)


def kserve_names(model: Model) -> st.SearchStrategy[str]:
    """As `names`, but the Open Inference Protocol names the model in every call (an empty name is refused at
    once): the served name seven times in ten, so that its requests get past it to the tensors."""
    return st.integers(0, 9).flatmap(lambda k: st.just(model.name) if k < 7 else names(model))


def _token_rows(model: Model) -> st.SearchStrategy[list[list[int]]]:
    """Lists of id lists: valid, edge or random int64, of odd lengths, including empty ones."""

    @st.composite
    def rows(draw: st.DrawFn) -> list[list[int]]:
        n = draw(st.one_of(st.integers(0, model.max_inputs + 2), st.sampled_from([0, 1, 500, 3000])))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        kind = draw(st.sampled_from(["valid", "edge", "int64", "mixed"]))
        out = []
        for _ in range(n):
            length = int(rng.choice([0, 1, 2, 7, model.max_tokens - 1, model.max_tokens, model.max_tokens + 1, 5000]))
            length = min(length, 200) if n > 50 else length
            if kind == "valid":
                row = rng.integers(0, model.vocab_size, length)
            elif kind == "edge":
                row = rng.choice([0, -1, model.vocab_size - 1, model.vocab_size, INT64_MIN, INT64_MAX], length)
            elif kind == "int64":
                row = rng.integers(INT64_MIN, INT64_MAX, length, dtype=np.int64, endpoint=True)
            else:
                row = np.where(rng.random(length) < 0.9, rng.integers(0, model.vocab_size, length), -5)
            out.append([int(v) for v in row])
        return out

    return rows()


@st.composite
def encode_requests(draw: st.DrawFn, model: Model) -> pb.EncodeRequest:
    """encoder.v1 EncodeRequest: texts, token_ids, both or neither; any model name, truncate, normalize."""
    kind = draw(st.sampled_from(["texts", "ids", "both", "none"]))
    request = pb.EncodeRequest(model=draw(names(model)))
    truncate = draw(st.none() | st.booleans())  # absent: the server's --auto-truncate
    if truncate is not None:
        request.truncate = truncate
    if kind in ("texts", "both"):
        count = draw(st.one_of(st.integers(0, model.max_inputs + 2), st.just(2000)))
        if count > 50:
            request.texts.extend([draw(st.text(max_size=3))] * count)
        else:
            request.texts.extend(draw(st.lists(texts(), min_size=count, max_size=count)))
    if kind in ("ids", "both"):
        request.token_ids.extend(pb.TokenIds(ids=row) for row in draw(_token_rows(model)))
    normalize = draw(st.none() | st.booleans())
    if normalize is not None:
        request.normalize = normalize
    return request


def request_ids() -> st.SearchStrategy[str]:
    """x-request-id values a client may send (gRPC metadata: printable ASCII)."""
    return st.one_of(st.text(PRINTABLE_ASCII, max_size=300), st.just(""))


def _parameter() -> st.SearchStrategy[kpb.InferParameter]:
    return st.one_of(
        st.booleans().map(lambda v: kpb.InferParameter(bool_param=v)),
        st.integers(INT64_MIN, INT64_MAX).map(lambda v: kpb.InferParameter(int64_param=v)),
        st.text(max_size=20).map(lambda v: kpb.InferParameter(string_param=v)),
        st.floats().map(lambda v: kpb.InferParameter(double_param=v)),
        st.integers(0, 2**64 - 1).map(lambda v: kpb.InferParameter(uint64_param=v)),
        st.just(kpb.InferParameter()),
    )


def _shape() -> st.SearchStrategy[list[int]]:
    dim = st.one_of(st.integers(-3, 12), st.sampled_from([0, 1, 160, 1000, 2**31, 2**40, INT64_MAX, INT64_MIN]))
    return st.lists(dim, max_size=4)


def _random_tensor(draw: st.DrawFn) -> tuple[kpb.ModelInferRequest.InferInputTensor, bytes | None]:
    tensor = kpb.ModelInferRequest.InferInputTensor(
        name=draw(st.one_of(st.sampled_from(["text", "input_ids", "attention_mask"]), st.text(max_size=12))),
        datatype=draw(st.one_of(st.sampled_from(["BYTES", "INT64", "INT32", "FP32", "BOOL", ""]), st.text(max_size=8))),
        shape=draw(_shape()),
    )
    contents = tensor.contents
    which = draw(st.sampled_from(["none", "bytes", "int64", "int", "fp32", "bool", "raw"]))
    if which == "bytes":
        contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=40), max_size=12)))
    elif which == "int64":
        contents.int64_contents.extend(draw(st.lists(st.integers(INT64_MIN, INT64_MAX), max_size=40)))
    elif which == "int":
        contents.int_contents.extend(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20)))
    elif which == "fp32":
        contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=20)))
    elif which == "bool":
        contents.bool_contents.extend(draw(st.lists(st.booleans(), max_size=20)))
    raw = draw(st.binary(max_size=200)) if which == "raw" else None
    return tensor, raw


def _text_tensor(draw: st.DrawFn, model: Model) -> tuple[kpb.ModelInferRequest.InferInputTensor, bytes | None]:
    items = draw(
        st.lists(st.one_of(texts().map(lambda t: t.encode()), st.binary(max_size=30)), max_size=model.max_inputs + 2)
    )
    n = len(items)
    shape = draw(st.sampled_from([[n], [n, 1], [n + 1], [max(n - 1, 0)], [n, 2], [], [1, n, 1]]))
    tensor = kpb.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=shape)
    if draw(st.booleans()):
        tensor.contents.bytes_contents.extend(items)
        return tensor, None
    raw = pack_bytes(items)
    cut = draw(st.sampled_from(["whole", "short", "long"]))
    if cut == "short" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif cut == "long":
        raw += draw(st.binary(min_size=1, max_size=8))
    return tensor, raw


def _id_tensors(draw: st.DrawFn, model: Model) -> list[tuple[kpb.ModelInferRequest.InferInputTensor, bytes | None]]:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = draw(st.sampled_from([0, 1, 2, 5, model.max_inputs, model.max_inputs + 1]))
    cols = draw(st.sampled_from([0, 1, 3, 17, model.max_tokens, model.max_tokens + 1]))
    values = draw(st.sampled_from(["valid", "edge", "int64"]))
    if values == "valid":
        ids = rng.integers(0, model.vocab_size, (rows, cols))
    elif values == "edge":
        ids = rng.choice([0, -1, model.vocab_size - 1, model.vocab_size, INT64_MIN, INT64_MAX], (rows, cols))
    else:
        ids = rng.integers(INT64_MIN, INT64_MAX, (rows, cols), dtype=np.int64, endpoint=True)
    masks = draw(st.sampled_from(["ones", "right-padded", "random01", "random", "zeros", "other-shape"]))
    if masks == "ones":
        mask = np.ones((rows, cols), dtype=np.int64)
    elif masks == "right-padded":
        lengths = rng.integers(0, cols + 1, rows)
        mask = (np.arange(cols) < lengths[:, None]).astype(np.int64)
    elif masks == "random01":
        mask = rng.integers(0, 2, (rows, cols))
    elif masks == "random":
        mask = rng.integers(-3, 4, (rows, cols))
    elif masks == "zeros":
        mask = np.zeros((rows, cols), dtype=np.int64)
    else:
        mask = np.ones((cols, rows + 1), dtype=np.int64)
    raw = draw(st.booleans())
    out: list[tuple[kpb.ModelInferRequest.InferInputTensor, bytes | None]] = []
    for name, array in (("input_ids", ids), ("attention_mask", mask)):
        tensor = kpb.ModelInferRequest.InferInputTensor(name=name, datatype="INT64", shape=list(array.shape))
        if raw:
            data = np.ascontiguousarray(array, dtype="<i8").tobytes()
            if draw(st.integers(0, 9)) == 0:  # now and then, one byte too few
                data = data[:-1]
            out.append((tensor, data))
        else:
            tensor.contents.int64_contents.extend(array.ravel().tolist())
            out.append((tensor, None))
    return out


@st.composite
def infer_requests(draw: st.DrawFn, model: Model) -> kpb.ModelInferRequest:
    """Open Inference Protocol ModelInferRequest: random tensors, malformed text, malformed ids, and valid ones."""
    request = kpb.ModelInferRequest(
        model_name=draw(kserve_names(model)),
        model_version=draw(
            st.integers(0, 9).flatmap(
                lambda k: st.sampled_from(["", "1"]) if k < 8 else st.sampled_from(["2", "-1", "01", " 1", "1\x00"])
            )
        ),
        id=draw(st.text(max_size=30)),
    )
    for key in draw(st.lists(st.one_of(st.sampled_from(["normalize", "truncate"]), st.text(max_size=10)), max_size=3)):
        request.parameters[key].CopyFrom(draw(_parameter()))
    for name in draw(st.lists(st.one_of(st.just("embeddings"), st.text(max_size=10)), max_size=2)):
        request.outputs.add(name=name)
    kind = draw(st.sampled_from(["random", "text", "ids", "text+ids"]))
    tensors: list[tuple[kpb.ModelInferRequest.InferInputTensor, bytes | None]] = []
    if kind == "random":
        tensors = [_random_tensor(draw) for _ in range(draw(st.integers(0, 4)))]
    if kind in ("text", "text+ids"):
        tensors.append(_text_tensor(draw, model))
    if kind in ("ids", "text+ids"):
        tensors.extend(_id_tensors(draw, model))
    raws = [raw for _, raw in tensors]
    use_raw = any(r is not None for r in raws)
    for tensor, _ in tensors:
        request.inputs.append(tensor)
    if use_raw:
        request.raw_input_contents.extend(r if r is not None else b"" for r in raws)
        extra = draw(st.sampled_from([0, 0, 0, 1, -1]))
        if extra == 1:
            request.raw_input_contents.append(b"\x00" * 8)
        elif extra == -1 and request.raw_input_contents:
            del request.raw_input_contents[-1]
    return request
