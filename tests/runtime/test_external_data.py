"""runtime/external_data.py: the external-data files a graph reads, found in its bytes without onnx."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import _get_all_tensors, uses_external_data

from mhaserve.runtime import external_data


def _onnx_says(path: Path) -> set[str]:
    """The files onnx itself finds a graph's tensors in."""
    model = onnx.load(str(path), load_external_data=False)
    return {
        next(e.value for e in t.external_data if e.key == "location")
        for t in _get_all_tensors(model)
        if uses_external_data(t)
    }


@pytest.mark.parametrize("graph", ["model.onnx", "model.int8.onnx", "model.fp16.onnx"])
@pytest.mark.parametrize("how", ["inline", "one file", "a file per tensor", "attributes too"])
def test_the_files_found_are_the_ones_onnx_finds(tiny_entry: Path, tmp_path: Path, graph: str, how: str) -> None:
    model = onnx.load(str(tiny_entry / graph))
    saved = tmp_path / graph
    if how == "inline":
        onnx.save_model(model, str(saved))
    else:
        onnx.save_model(
            model,
            str(saved),
            save_as_external_data=True,
            all_tensors_to_one_file=how == "one file",
            location="model.onnx.data",
            size_threshold=0,
            convert_attribute=how == "attributes too",
        )
    found = external_data.locations(saved)
    assert found == _onnx_says(saved)
    assert bool(found) == (how != "inline")
    if how == "a file per tensor":
        assert len(found) > 1


def _external(name: str, location: str) -> TensorProto:
    tensor = numpy_helper.from_array(np.ones(4, dtype=np.float32), name)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        tensor.external_data.add(key=key, value=value)
    return tensor


def test_every_place_a_tensor_can_be_is_read(tmp_path: Path) -> None:
    """Initializers, a Constant's tensor, sparse tensors, the branches of an If, a function's nodes: onnx's own
    helper reads the first two, ONNX Runtime reads them all."""
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])

    def branch(location: str) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node("Identity", ["w"], ["y"])], "branch", [], [out], initializer=[_external("w", location)]
        )

    sparse = helper.make_sparse_tensor(_external("s", "sparse-values.bin"), _external("si", "sparse-indices.bin"), [8])
    nodes = [
        helper.make_node("Constant", [], ["c"], value=_external("c", "constant.bin")),
        helper.make_node("If", ["cond"], ["y"], then_branch=branch("then.bin"), else_branch=branch("else.bin")),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [out],
        initializer=[_external("i", "initializer.bin")],
        sparse_initializer=[sparse],
    )
    function = helper.make_function(
        "local", "f", [], ["z"], [helper.make_node("Constant", [], ["z"], value=_external("z", "function.bin"))], []
    )
    model = helper.make_model(graph, functions=[function])
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    assert external_data.locations(path) == {
        "initializer.bin",
        "constant.bin",
        "then.bin",
        "else.bin",
        "sparse-values.bin",
        "sparse-indices.bin",
        "function.bin",
    }


def _tag(number: int, wire: int) -> bytes:
    return bytes([number << 3 | wire])  # numbers below 16: one byte


def test_fields_protobuf_keeps_as_unknown_are_stepped_over(tmp_path: Path) -> None:
    """A group, fixed-size fields, and external_data's number with a varint's wire type, before the entries: protobuf
    parses such a tensor (keeping them as unknown fields), so ONNX Runtime reads its file, and the walk finds it."""
    unknown = (
        _tag(15, 3) + _tag(1, 0) + b"\x05" + _tag(2, 3) + _tag(2, 4) + _tag(15, 4)  # a group, another inside
        + _tag(14, 1) + bytes(8) + _tag(14, 5) + bytes(4)  # data_location's number as fixed64 and fixed32
        + _tag(13, 0) + b"\x01"  # external_data's number as a varint
    )  # fmt: skip
    tensor = TensorProto()
    tensor.ParseFromString(unknown + _external("w", "odd.bin").SerializeToString())
    assert [e.value for e in tensor.external_data if e.key == "location"] == ["odd.bin"]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [], [out], initializer=[tensor])
    path = tmp_path / "model.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    assert external_data.locations(path) == {"odd.bin"}


def test_its_table_of_where_tensors_are_is_onnx_own() -> None:
    """Every field of ONNX's messages that holds a tensor, or a message that may hold one, is in the table the
    walk follows: a field it missed would be a tensor whose file goes unchecked."""
    holders = {TensorProto.DESCRIPTOR}
    seen, todo = set(), [onnx.ModelProto.DESCRIPTOR]
    while todo:
        message = todo.pop()
        if message not in seen:
            seen.add(message)
            todo += [f.message_type for f in message.fields if f.message_type is not None]
    while True:
        more = {m for m in seen if any(f.message_type in holders for f in m.fields)} - holders
        if not more:
            break
        holders |= more
    expected = {
        m.name: {f.number: f.message_type.name for f in m.fields if f.message_type in holders}
        for m in holders - {TensorProto.DESCRIPTOR}
    }
    assert expected == external_data.WHERE
    field = TensorProto.DESCRIPTOR.fields_by_name["external_data"]
    assert field.number == external_data.EXTERNAL_DATA and field.message_type is not None
    entry = field.message_type.fields_by_name
    assert (entry["key"].number, entry["value"].number) == (external_data.KEY, external_data.VALUE)


def test_bytes_that_are_no_graph_are_read_without_an_error(tiny_entry: Path, tmp_path: Path) -> None:
    """A graph cut short, or no protobuf at all: ONNX Runtime refuses to load it as a whole, so no file it names
    is read; the walk stops where the bytes stop making sense, keeping what it found before."""
    model = onnx.load(str(tiny_entry / "model.onnx"))
    whole = tmp_path / "whole.onnx"
    onnx.save_model(model, str(whole), save_as_external_data=True, location="w.data", size_threshold=0)
    raw = whole.read_bytes()
    for i, cut in enumerate([raw[:2000], raw[:-1], b"", b"\xff" * 64, b"not a graph at all", b"\x0b\x0c"]):
        path = tmp_path / f"{i}.onnx"
        path.write_bytes(cut)
        assert external_data.locations(path) <= {"w.data"}


@pytest.mark.parametrize("location", ["./model.onnx.data", "././model.onnx.data"])
def test_a_leading_dot_slash_names_the_file_itself(tiny_entry: Path, tmp_path: Path, location: str) -> None:
    """onnx.save with location="./model.onnx.data" (some converters write it so) writes that spelling into the
    graph; ONNX Runtime reads it from the graph's folder, the file model.onnx.data, and so the walk names it."""
    saved = tmp_path / "model.onnx"
    onnx.save_model(
        onnx.load(str(tiny_entry / "model.onnx")),
        str(saved),
        save_as_external_data=True,
        location=location,
        size_threshold=1024,  # the weights; ONNX Runtime reads a shape's few bytes only from the graph itself
    )
    assert _onnx_says(saved) == {location}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    ort.InferenceSession(str(saved), providers=["CPUExecutionProvider"])  # ONNX Runtime reads it there
    assert external_data.locations(saved) == {"model.onnx.data"}


# What is left as it is written: a path that is not the leading `./` of a plain name, for the manifest to refuse.
ELSEWHERE = [
    "../model.onnx.data",
    "./../model.onnx.data",
    "sub/../model.onnx.data",
    "./sub/../model.onnx.data",
    "sub/model.onnx.data",
    ".//model.onnx.data",  # `./` and then an absolute path, were only the `./` dropped
    "/model.onnx.data",
    "./",
    "./.",
    "./..",
    ".\\model.onnx.data",  # on POSIX a file of that name, not model.onnx.data
    "",
    "./model.onnx.data\x00x",  # ONNX Runtime reads up to the NUL: kept whole, for the manifest to refuse
]


@pytest.mark.parametrize("location", ELSEWHERE)
def test_other_paths_are_named_as_written(tmp_path: Path, location: str) -> None:
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])], "g", [], [out], initializer=[_external("w", location)]
    )
    path = tmp_path / "model.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    assert external_data.locations(path) == {location}
