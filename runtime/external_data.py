"""The external-data files an ONNX graph's tensors are read from, found in the graph's bytes.

A graph that would pass protobuf's 2 GiB keeps its tensors' bytes apart (an export past 1.5 GB writes every
weight to `model.onnx.data`): each such tensor holds `external_data` entries naming a file (`location`), an
offset and a length, and ONNX Runtime reads the bytes from there. The manifest vouches for those files too,
so the server must know which they are; it does not install onnx, and onnx.load of a graph that holds its
weights would read them all into memory. This walks the protobuf wire format instead, and steps over the
tensors' bytes unread.
"""

from __future__ import annotations

import contextlib
import mmap
from pathlib import Path

# Where a tensor may be, by ONNX message and field number (onnx/onnx.proto): each field whose message is a
# TensorProto or may hold one, down from ModelProto. Initializers and Constant nodes' tensors, but also an
# If's or a Loop's subgraphs, sparse tensors, functions' nodes and training graphs: ONNX Runtime reads
# external data wherever a tensor is. tests/runtime/test_external_data.py checks it against onnx's own
# descriptors.
WHERE: dict[str, dict[int, str]] = {
    "ModelProto": {7: "GraphProto", 20: "TrainingInfoProto", 25: "FunctionProto"},
    "TrainingInfoProto": {1: "GraphProto", 2: "GraphProto"},
    "FunctionProto": {7: "NodeProto", 11: "AttributeProto"},
    "GraphProto": {1: "NodeProto", 5: "TensorProto", 15: "SparseTensorProto"},
    "NodeProto": {5: "AttributeProto"},
    "AttributeProto": {
        5: "TensorProto",
        6: "GraphProto",
        10: "TensorProto",
        11: "GraphProto",
        22: "SparseTensorProto",
        23: "SparseTensorProto",
    },
    "SparseTensorProto": {1: "TensorProto", 2: "TensorProto"},
}
EXTERNAL_DATA = 13  # TensorProto.external_data: StringStringEntryProto entries
KEY, VALUE = 1, 2  # StringStringEntryProto.key, .value
_VARINT, _I64, _LEN, _GROUP_START, _GROUP_END, _I32 = range(6)


class _Malformed(ValueError):
    """Bytes that are no protobuf message."""


def locations(path: Path) -> set[str]:
    """The `location` of each of the graph's tensors whose bytes are in an external-data file: file names,
    relative to the graph's folder, a leading `./` dropped (file_name).

    Every tensor that names a location counts, whatever its `data_location` says: a file listed that ONNX
    Runtime would not read costs a checksum, one left out would be read unchecked. Bytes that are no
    protobuf (a graph cut short) end the walk, keeping what it found before: ONNX Runtime refuses such a
    file as a whole, and reads none of the files it names."""
    found: set[str] = set()
    with path.open("rb") as f:
        if f.seek(0, 2) == 0:
            return found  # mmap cannot map an empty file, which names nothing
        # Mapped, not read: a graph that holds its weights may be 1.5 GB, and the walk skips them unread.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data, contextlib.suppress(_Malformed):
            _walk(data, found)
    return found


def file_name(location: str) -> str:
    """The file of the graph's folder that `location` names, `model.onnx.data` for `./model.onnx.data` (as
    onnx.save(..., location="./model.onnx.data") and some converters write it); any other location as it is
    written, for the manifest to refuse unless it is a plain file name.

    ONNX Runtime and onnx join a location to the graph's folder, and `./` is that folder itself whatever the
    file system holds, so a leading `./` (or several) names the same file as the name after it. Nothing else
    is made plain, though ONNX Runtime reads some of it from the folder too: `sub/../x` is `x` only while `sub`
    is a folder and no link (a link's `..` is its target's parent), `.//x` would be the absolute `/x` with only
    its `./` dropped, and a backslash is no separator on POSIX (`.\\x` is a file of that name). A name left
    with a `/` or a NUL (ONNX Runtime reads a C string: up to the NUL), empty, `.` or `..` is no file of the
    folder: the location is kept whole then, not a part of it that the manifest would take for a file of the
    version."""
    start = 0
    while location.startswith("./", start):  # counted, then cut once: a long run of `./` costs no copies
        start += 2
    name = location[start:]
    return name if name not in ("", ".", "..") and "/" not in name and "\x00" not in name else location


def _walk(data: mmap.mmap, found: set[str]) -> None:
    # A stack, not recursion: subgraphs nest as deep as a file says.
    todo = [("ModelProto", 0, len(data))]
    while todo:
        message, start, end = todo.pop()
        if message == "TensorProto":
            for number, at, stop in _fields(data, start, end):
                if number == EXTERNAL_DATA:
                    key, location = _entry(data, at, stop)
                    if key == b"location":
                        found.add(file_name(location.decode("utf-8", "surrogateescape")))
            continue
        children = WHERE[message]
        for number, at, stop in _fields(data, start, end):
            if number in children:
                todo.append((children[number], at, stop))


def _entry(data: mmap.mmap, start: int, end: int) -> tuple[bytes, bytes]:
    """A StringStringEntryProto's key and value (of a field written twice, the last: protobuf keeps that one)."""
    key = value = b""
    for number, at, stop in _fields(data, start, end):
        if number == KEY:
            key = data[at:stop]
        elif number == VALUE:
            value = data[at:stop]
    return key, value


def _fields(data: mmap.mmap, pos: int, end: int) -> list[tuple[int, int, int]]:
    """(number, start, stop) of each length-delimited field of the message in data[pos:end]: every field this
    walk reads is one. The others are stepped over, and so is a field of a number it reads that comes with
    another wire type: protobuf keeps such a field as an unknown one."""
    out = []
    while pos < end:
        tag, pos = _varint(data, pos, end)
        number, wire = tag >> 3, tag & 7
        if number == 0 or tag > 0xFFFFFFFF:
            raise _Malformed
        if wire == _VARINT:
            _, pos = _varint(data, pos, end)
        elif wire == _LEN:
            size, pos = _varint(data, pos, end)
            if size > end - pos:
                raise _Malformed
            out.append((number, pos, pos + size))
            pos += size
        elif wire in (_I64, _I32):
            pos += 8 if wire == _I64 else 4
            if pos > end:
                raise _Malformed
        elif wire == _GROUP_START:
            pos = _skip_group(data, pos, end, number)
        else:  # an end of group outside one, or wire types 6 and 7
            raise _Malformed
    return out


def _skip_group(data: mmap.mmap, pos: int, end: int, number: int) -> int:
    """Past the end of the group `number` that starts at `pos` (a proto2 group: ONNX has none, protobuf
    parses one as an unknown field)."""
    depth = [number]
    while depth:
        if pos >= end:
            raise _Malformed
        tag, pos = _varint(data, pos, end)
        n, wire = tag >> 3, tag & 7
        if n == 0:
            raise _Malformed
        if wire == _VARINT:
            _, pos = _varint(data, pos, end)
        elif wire == _LEN:
            size, pos = _varint(data, pos, end)
            pos += size
        elif wire in (_I64, _I32):
            pos += 8 if wire == _I64 else 4
        elif wire == _GROUP_START:
            depth.append(n)
        elif wire == _GROUP_END and n == depth[-1]:
            depth.pop()
        else:
            raise _Malformed
        if pos > end:
            raise _Malformed
    return pos


def _varint(data: mmap.mmap, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(pos, min(pos + 10, end)):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    raise _Malformed  # cut short, or longer than the 10 bytes of a 64-bit varint
