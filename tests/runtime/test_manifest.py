"""runtime/manifest.py: a manifest that cannot be trusted is refused in one line naming its key."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx.external_data_helper import _get_all_tensors

from mhaserve.runtime import manifest as mf
from tests.runtime.test_digests import count_hashing, flip_keeping_times, settled


def _edited(entry: Path, tmp_path: Path, edit: Any) -> Path:
    copy = tmp_path / "m" / "1"
    shutil.copytree(entry, copy)
    data = json.loads((copy / mf.MANIFEST).read_text())
    (copy / mf.MANIFEST).write_text(json.dumps(edit(data)))
    return copy


def _set(key: str, value: Any) -> Any:
    return lambda d: d | {key: value}


def _drop(key: str) -> Any:
    return lambda d: {k: v for k, v in d.items() if k != key}


def _graph(key: str, value: Any) -> Any:
    return lambda d: d | {"graphs": {"fp32": d["graphs"]["fp32"] | {key: value}}}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: [1, 2], "the manifest must be a JSON object, got list"),
        (_set("max_seq_len", -5), "'max_seq_len' must not be negative, got -5"),
        (_set("max_seq_len", 0), "manifest key 'max_seq_len' must be at least 1, got 0"),
        (_set("vocab_size", "many"), "'vocab_size' must be an integer, got \"many\""),
        # refused by ONNX Runtime's warm-up as a bare broadcast error in node 'node_add_7', naming no file or key
        (_set("max_seq_len", 100_000), "'max_seq_len' (100000) exceeds 'max_positions' (160): the graph has no"),
        # it was served, and reported by GetModelInfo, while the graph pooled by mean
        (_set("pooling", "max"), "manifest key 'pooling' must be one of mean, cls, got 'max'"),
        (_set("version", True), "'version' must be an integer, got true"),
        (_set("normalize", 1), "'normalize' must be true or false, got 1"),
        (_set("name", None), "'name' must be a string, got null"),
        (_drop("graphs"), "the manifest lacks the key 'graphs'"),
        (_set("graphs", {}), "'graphs' must be an object naming at least one graph"),
        (_set("graphs", {"fp32": "model.onnx"}), "graph 'fp32' must be a JSON object, got str"),
        (_graph("sha256", 5), "graph 'fp32': 'sha256' must be a string, got 5"),
        (_graph("extra", 1), "graph 'fp32' has an unknown key 'extra'"),
        (_graph("external_data", []), "graph 'fp32': 'external_data' must be an object, got []"),
        (_graph("external_data", {"model.onnx.data": 5}), "'external_data' must map file names to sha256 digests"),
        (_set("surprise", 1), "the manifest has an unknown key 'surprise'"),
        (_set("format", 2), "unsupported manifest format 2"),
        (_drop("format"), "unsupported manifest format None"),
    ],
)
def test_a_malformed_manifest_is_refused_naming_the_key(
    tiny_entry: Path, tmp_path: Path, edit: Any, message: str
) -> None:
    copy = _edited(tiny_entry, tmp_path, edit)
    with pytest.raises(mf.ManifestError) as e:
        mf.read_manifest(copy)
    assert str(e.value).startswith(f"{copy / mf.MANIFEST}: ") and message in str(e.value)


def test_a_whole_manifest_reads_as_written(tiny_entry: Path, tmp_path: Path) -> None:
    copy = _edited(tiny_entry, tmp_path, lambda d: d)
    assert mf.read_manifest(copy) == mf.read_manifest(tiny_entry)
    optional = _edited(tiny_entry, tmp_path / "o", _drop("tokenizer_sha256"))  # written before it was recorded
    assert mf.read_manifest(optional).tokenizer_sha256 == ""


def test_a_manifest_saved_with_a_byte_order_mark_reads_as_without(tiny_entry: Path, tmp_path: Path) -> None:
    """Windows' Notepad saves UTF-8 with a byte order mark: a manifest edited there was refused, "Unexpected
    UTF-8 BOM", where the HTTP API reads such a body (docs/http.md)."""
    copy = _edited(tiny_entry, tmp_path, lambda d: d)
    (copy / mf.MANIFEST).write_bytes(b"\xef\xbb\xbf" + (copy / mf.MANIFEST).read_bytes())
    assert mf.read_manifest(copy) == mf.read_manifest(tiny_entry)


def with_external_data(entry: Path, target: Path, *, one_file: bool = True, location: str = "model.onnx.data") -> Path:
    """`target`: `entry`'s fp32 graph alone, its weights in external-data files (one, or one per tensor), with a
    manifest that vouches for them as an export past 1.5 GB writes it. `location`: how the graph spells the one
    file (onnx.save writes it as given)."""
    target.mkdir(parents=True)
    shutil.copy(entry / mf.TOKENIZER, target)
    onnx.save_model(
        onnx.load(str(entry / "model.onnx")),
        str(target / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=one_file,
        location=location,
        size_threshold=1024,  # the weights; ONNX Runtime reads a shape's few bytes only from the graph itself
    )
    manifest = json.loads((entry / mf.MANIFEST).read_text())
    data = {p.name: mf.sha256_file(p) for p in target.iterdir() if p.name not in ("model.onnx", mf.TOKENIZER)}
    graph = {"sha256": mf.sha256_file(target / "model.onnx"), "external_data": data}
    manifest["graphs"] = {"fp32": manifest["graphs"]["fp32"] | graph}
    (target / mf.MANIFEST).write_text(json.dumps(manifest))
    return target


def _flip(path: Path) -> None:
    """One byte of `path` changed: a weight off, the file's size and every other byte as they were."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_external_data_is_checked_as_the_graph_is(tiny_entry: Path, tmp_path: Path) -> None:
    """Past 1.5 GB every weight is in model.onnx.data, and model.onnx's sha256 vouches only for the names of
    the files: theirs are checked too, a mismatch or a missing file refused as a graph's is."""
    entry = with_external_data(tiny_entry, tmp_path / "m" / "1")
    graph = mf.read_manifest(entry).graph("fp32")
    assert list(graph.external_data or {}) == ["model.onnx.data"]
    assert mf.verify_graph(entry, graph) == entry / "model.onnx"
    data = entry / "model.onnx.data"
    _flip(data)
    with pytest.raises(mf.ManifestError) as e:
        mf.verify_graph(entry, graph)
    assert re.fullmatch(
        f"external data {re.escape(str(data))} of graph {re.escape(str(entry / 'model.onnx'))} fails its checksum: "
        "sha256 [0-9a-f]{12}…, manifest says [0-9a-f]{12}…",
        str(e.value),
    ), str(e.value)
    data.unlink()
    with pytest.raises(mf.ManifestError, match=f"^external data {re.escape(str(data))} of graph .* is missing$"):
        mf.verify_graph(entry, graph)


def test_each_of_several_external_data_files_is_checked(tiny_entry: Path, tmp_path: Path) -> None:
    entry = with_external_data(tiny_entry, tmp_path / "m" / "1", one_file=False)
    graph = mf.read_manifest(entry).graph("fp32")
    assert graph.external_data is not None and len(graph.external_data) > 1
    mf.verify_graph(entry, graph)
    one = sorted(graph.external_data)[-1]
    _flip(entry / one)
    with pytest.raises(mf.ManifestError, match=f"external data {re.escape(str(entry / one))} of graph .* fails its"):
        mf.verify_graph(entry, graph)


def test_external_data_the_manifest_does_not_list_is_refused(tiny_entry: Path, tmp_path: Path) -> None:
    """A graph saved again with its weights apart, its sha256 updated and not its external data: the server
    would read bytes no manifest vouches for."""
    entry = with_external_data(tiny_entry, tmp_path / "m" / "1")
    manifest = json.loads((entry / mf.MANIFEST).read_text())
    manifest["graphs"]["fp32"]["external_data"] = {}
    (entry / mf.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(mf.ManifestError, match="reads external data 'model.onnx.data' that its manifest does not list"):
        mf.verify_graph(entry, mf.read_manifest(entry).graph("fp32"))


def test_external_data_must_be_a_file_of_the_entry(tiny_entry: Path, tmp_path: Path) -> None:
    entry = with_external_data(tiny_entry, tmp_path / "m" / "1")
    manifest = json.loads((entry / mf.MANIFEST).read_text())
    manifest["graphs"]["fp32"]["external_data"]["../model.onnx.data"] = "0" * 64
    (entry / mf.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(mf.ManifestError, match=r"external data file '../model.onnx.data' .* must be a plain file name"):
        mf.verify_graph(entry, mf.read_manifest(entry).graph("fp32"))


def reading_from(entry: Path, location: str) -> None:
    """`entry` (with_external_data's) with its graph's weights read from `location`, written as it is (onnx.save
    refuses some), and `sub/model.onnx.data` beside the file for a location that reaches it through `sub`; the
    manifest vouches for the graph, and lists model.onnx.data with its right sha256."""
    (entry / "sub").mkdir()
    shutil.copy(entry / "model.onnx.data", entry / "sub")
    model = onnx.load(str(entry / "model.onnx"), load_external_data=False)
    for tensor in _get_all_tensors(model):
        for e in tensor.external_data:
            if e.key == "location":
                e.value = location
    onnx.save_model(model, str(entry / "model.onnx"))
    manifest = json.loads((entry / mf.MANIFEST).read_text())
    manifest["graphs"]["fp32"]["sha256"] = mf.sha256_file(entry / "model.onnx")
    (entry / mf.MANIFEST).write_text(json.dumps(manifest))


def _written_by_graph_entry(entry: Path) -> None:
    """The entry's manifest written as export and import write theirs: GraphEntry.of, from the graph."""
    manifest = json.loads((entry / mf.MANIFEST).read_text())
    old = manifest["graphs"]["fp32"]
    of = mf.GraphEntry.of(entry / "model.onnx", precision="fp32", optimized=False, parity=old["parity"])
    manifest["graphs"]["fp32"] = dataclasses.asdict(of)
    (entry / mf.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("location", ["./model.onnx.data", "././model.onnx.data"])
@pytest.mark.parametrize("written", ["listing the folder", "by GraphEntry.of"])
def test_external_data_named_with_a_leading_dot_slash_is_the_version_own(
    tiny_entry: Path, tmp_path: Path, location: str, written: str
) -> None:
    """onnx.save(..., location="./model.onnx.data"), as some converters write it: ONNX Runtime reads the same
    file as from "model.onnx.data", and so the manifest names it model.onnx.data and checks it (it was refused
    as a file the manifest does not list, or as no plain file name)."""
    entry = with_external_data(tiny_entry, tmp_path / "m" / "1", location=location)
    if written == "by GraphEntry.of":
        _written_by_graph_entry(entry)
    graph = mf.read_manifest(entry).graph("fp32")
    assert graph.external_data == {"model.onnx.data": mf.sha256_file(entry / "model.onnx.data")}
    assert mf.verify_graph(entry, graph) == entry / "model.onnx"
    _flip(entry / "model.onnx.data")
    with pytest.raises(mf.ManifestError, match="external data .*model.onnx.data of graph .* fails its checksum"):
        mf.verify_graph(entry, graph)


@pytest.mark.parametrize(
    "location",
    [
        "../model.onnx.data",
        "./../model.onnx.data",
        "sub/../model.onnx.data",  # were `sub` a link to another folder, its `..` would be that folder's parent
        "./sub/../model.onnx.data",
        "sub/model.onnx.data",
        ".//model.onnx.data",
        "ABSOLUTE",  # the version's own model.onnx.data, by its absolute path
        "./",
        "./model.onnx.data\x00x",  # ONNX Runtime reads up to the NUL: model.onnx.data
    ],
)
def test_external_data_elsewhere_than_a_file_of_the_version_is_refused(
    tiny_entry: Path, tmp_path: Path, location: str
) -> None:
    """Only a leading `./` is dropped: any other path is refused, even one that names the version's own
    model.onnx.data, listed with its right sha256, and even if ONNX Runtime would read it."""
    entry = with_external_data(tiny_entry, tmp_path / "m" / "1")
    location = str(entry / "model.onnx.data") if location == "ABSOLUTE" else location
    reading_from(entry, location)
    graph = mf.read_manifest(entry).graph("fp32")
    assert graph.external_data == {"model.onnx.data": mf.sha256_file(entry / "model.onnx.data")}
    with pytest.raises(mf.ManifestError) as e:
        mf.verify_graph(entry, graph)
    assert str(e.value) == (
        f"graph {entry / 'model.onnx'} reads external data {location!r}, which is no plain file name inside "
        f"{entry}: a graph may read only files of its own version's folder"
    )


@pytest.mark.parametrize("location", ["../elsewhere.data", "sub/../../elsewhere.data"])
def test_graph_entry_of_a_graph_that_reads_a_file_elsewhere_is_refused_before_it_is_read(
    tiny_entry: Path, tmp_path: Path, location: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GraphEntry.of (export and import write the manifest with it) hashed each file the graph names, joined to
    its folder: a graph reading `../x` had it read a file of another folder, to write a manifest verify_graph then
    refuses. It is refused before anything is read, as verify_graph refuses it."""
    entry = with_external_data(tiny_entry, tmp_path / "m" / "1")
    shutil.copy(entry / "model.onnx.data", tmp_path / "m" / "elsewhere.data")
    reading_from(entry, location)  # (makes sub/)
    hashed = count_hashing(monkeypatch)
    with pytest.raises(mf.ManifestError) as e:
        mf.GraphEntry.of(entry / "model.onnx", precision="fp32", optimized=False, parity={})
    assert str(e.value) == (
        f"graph {entry / 'model.onnx'} reads external data {location!r}, which is no plain file name inside "
        f"{entry}: a graph may read only files of its own version's folder"
    )
    assert hashed == []


def test_external_data_linked_out_of_the_version_folder_is_refused(tiny_entry: Path, tmp_path: Path) -> None:
    """model.onnx.data a symbolic link to a file outside the version's folder: its bytes match the manifest (the
    hash follows the link), but a version reads only files of its own folder (docs/security.md), which ONNX Runtime
    1.31 enforces too at the session, and older ones need not. A link to a file of the folder itself is fine."""
    entry = with_external_data(tiny_entry, tmp_path / "m" / "1")
    graph = mf.read_manifest(entry).graph("fp32")
    outside = tmp_path / "elsewhere.data"
    (entry / "model.onnx.data").rename(outside)
    (entry / "model.onnx.data").symlink_to(outside)
    with pytest.raises(mf.ManifestError) as e:
        mf.verify_graph(entry, graph)
    assert str(e.value) == (
        f"external data {entry / 'model.onnx.data'} of graph {entry / 'model.onnx'} is a link to {outside}, outside "
        f"{entry}: a graph may read only files of its own version's folder"
    )
    (entry / "model.onnx.data").unlink()
    outside.rename(entry / "weights.bin")
    (entry / "model.onnx.data").symlink_to("weights.bin")
    assert mf.verify_graph(entry, graph) == entry / "model.onnx"


def test_a_manifest_that_lists_the_data_as_dot_slash_model_onnx_data_names_the_same_file(
    tiny_entry: Path, tmp_path: Path
) -> None:
    """A manifest written with the graph's own spelling (GraphEntry.of recorded `./model.onnx.data` as it was
    written, before it made it plain): the same file, checked, not refused as a file the manifest does not list."""
    entry = with_external_data(tiny_entry, tmp_path / "m" / "1", location="./model.onnx.data")
    manifest = json.loads((entry / mf.MANIFEST).read_text())
    data = manifest["graphs"]["fp32"]["external_data"]
    manifest["graphs"]["fp32"]["external_data"] = {"./model.onnx.data": data.pop("model.onnx.data")}
    (entry / mf.MANIFEST).write_text(json.dumps(manifest))
    graph = mf.read_manifest(entry).graph("fp32")
    assert mf.verify_graph(entry, graph) == entry / "model.onnx"
    _flip(entry / "model.onnx.data")
    with pytest.raises(mf.ManifestError, match="external data .*model.onnx.data of graph .* fails its checksum"):
        mf.verify_graph(entry, graph)


@pytest.mark.parametrize("unrecorded", [_drop("external_data"), lambda g: g | {"external_data": None}])
def test_a_manifest_written_before_external_data_was_recorded_still_loads(
    tiny_entry: Path, tmp_path: Path, unrecorded: Any
) -> None:
    """Its graphs' sha256 is checked and their external data, which it does not name, is not (docs/models.md)."""
    entry = with_external_data(tiny_entry, tmp_path / "m" / "1")
    manifest = json.loads((entry / mf.MANIFEST).read_text())
    manifest["graphs"]["fp32"] = unrecorded(manifest["graphs"]["fp32"])
    (entry / mf.MANIFEST).write_text(json.dumps(manifest))
    graph = mf.read_manifest(entry).graph("fp32")
    assert graph.external_data is None
    _flip(entry / "model.onnx.data")
    assert mf.verify_graph(entry, graph) == entry / "model.onnx"


def test_a_file_unchanged_since_its_check_is_not_read_again(
    tiny_entry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server checks a model at start-up and again as it loads it: past 1.5 GB, seconds a gigabyte each."""
    entry = with_external_data(tiny_entry, tmp_path / "m" / "1")
    graph = mf.read_manifest(entry).graph("fp32")
    settled(monkeypatch)
    hashed = count_hashing(monkeypatch)
    mf.verify_graph(entry, graph)
    assert len(hashed) == 2  # model.onnx and model.onnx.data
    mf.verify_graph(entry, graph)
    assert len(hashed) == 2


def _replaced_by_a_rename(path: Path) -> None:
    """Other bytes of the same size and modification time put in `path`'s place, as a copy-then-rename does."""
    was = path.stat()
    other = path.with_name(f".{path.name}.new")
    other.write_bytes(bytes(reversed(path.read_bytes())))
    os.utime(other, ns=(was.st_atime_ns, was.st_mtime_ns))
    other.replace(path)


@pytest.mark.parametrize(
    "change", [flip_keeping_times, _replaced_by_a_rename], ids=["rewritten, its times kept", "replaced by a rename"]
)
def test_a_file_changed_since_its_check_is_read_again(
    tiny_entry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Callable[[Path], None]
) -> None:
    """A rewrite gives itself away by its change time (a write sets it, and no user can set it back: os.utime sets
    the others), a rename by its inode."""
    entry = with_external_data(tiny_entry, tmp_path / "m" / "1")
    graph = mf.read_manifest(entry).graph("fp32")
    settled(monkeypatch)
    mf.verify_graph(entry, graph)
    change(entry / "model.onnx.data")
    with pytest.raises(mf.ManifestError, match="model.onnx.data of graph .* fails its checksum"):
        mf.verify_graph(entry, graph)


@pytest.mark.parametrize(
    "text",
    [b'{"name": "m", "version": 1' + b"0" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000, b'{"name": "\xff"}'],
    ids=["a 5000-digit number", "nested past the recursion limit", "not UTF-8"],
)
def test_a_manifest_that_does_not_read_as_json_is_refused_naming_the_file(tmp_path: Path, text: bytes) -> None:
    """Each was a bare ValueError, RecursionError or UnicodeDecodeError: a load failure that named no file."""
    (tmp_path / mf.MANIFEST).write_bytes(text)
    with pytest.raises(mf.ManifestError, match=f"^{tmp_path / mf.MANIFEST} is not valid JSON"):
        mf.read_manifest(tmp_path)


def test_a_model_name_is_refused_saying_which_rule_it_breaks() -> None:
    """A name of 300 valid characters was told to use lower-case letters, digits, '.', '_' and '-', which it
    did (a review's finding): its length is the rule it breaks. One beginning with '.' or '-' is told so."""
    assert mf.check_name("a" * 128) == "a" * 128
    with pytest.raises(mf.ManifestError, match=r"\(129 characters\): at most 128$"):
        mf.check_name("a" * 129)
    for name in ("Bad/Name", ".hidden", "-x", "", "a" * 200 + "/Bad"):  # (the last too long too: both said)
        with pytest.raises(mf.ManifestError, match="lower-case letters, digits, '.', '_' and '-', beginning with"):
            mf.check_name(name)
