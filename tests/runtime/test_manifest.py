"""runtime/manifest.py: a manifest that cannot be trusted is refused in one line naming its key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mhaserve.runtime import manifest as mf


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
        (_set("version", True), "'version' must be an integer, got true"),
        (_set("normalize", 1), "'normalize' must be true or false, got 1"),
        (_set("name", None), "'name' must be a string, got null"),
        (_drop("graphs"), "the manifest lacks the key 'graphs'"),
        (_set("graphs", {}), "'graphs' must be an object naming at least one graph"),
        (_set("graphs", {"fp32": "model.onnx"}), "graph 'fp32' must be a JSON object, got str"),
        (_graph("sha256", 5), "graph 'fp32': 'sha256' must be a string, got 5"),
        (_graph("extra", 1), "graph 'fp32' has an unknown key 'extra'"),
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
