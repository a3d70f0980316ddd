"""Which graph `--graph auto` serves: the fused graph for where the model runs, older entries falling back."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from mhaserve.runtime import manifest as mf
from mhaserve.runtime import serving
from mhaserve.runtime.repository import ModelRepository, RepositoryError, auto_graph

ALL = ("fp32", "optimized", "optimized-cpu", "fp16", "int8")


@pytest.mark.parametrize(
    ("graphs", "device", "want"),
    [
        (ALL, "cpu", "optimized-cpu"),  # the layer norms as plain operators: ONNX Runtime's CPU kernel is slow
        (ALL, "cuda", "optimized"),  # CUDA's fused layer norm is the fast one
        (("fp32", "optimized", "fp16", "int8"), "cpu", "optimized"),  # exported before optimized-cpu existed
        (("fp32", "fp16", "int8"), "cpu", "fp32"),  # never int8 or fp16: not within the parity gate
        (("fp32", "optimized-cpu"), "cuda", "fp32"),  # never the CPU graph on CUDA
    ],
)
def test_auto_picks_the_fused_graph_for_the_device(graphs: tuple[str, ...], device: str, want: str) -> None:
    assert auto_graph(graphs, device) == want  # type: ignore[arg-type]


def _without_cpu_graph(tiny_entry: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model as an export before the CPU graph wrote it."""
    entry = tmp_path / "old" / "1"
    shutil.copytree(tiny_entry, entry)
    (entry / "model.optimized-cpu.onnx").unlink()
    manifest = json.loads((entry / mf.MANIFEST).read_text())
    del manifest["graphs"]["optimized-cpu"]
    (entry / mf.MANIFEST).write_text(json.dumps(manifest))
    return entry


def test_the_repository_serves_auto_as_the_device_asks(tiny_entry: Path, tmp_path: Path) -> None:
    repo = ModelRepository(tiny_entry.parent.parent)
    cpu = repo.entry("tiny", graph="auto", device="cpu")
    assert cpu.graph == "optimized-cpu" and cpu.graph_path.name == "model.optimized-cpu.onnx"
    assert cpu.sha256 == mf.read_manifest(tiny_entry).graphs["optimized-cpu"].sha256
    assert repo.entry("tiny", graph="auto", device="cuda").graph == "optimized"
    assert repo.entry("tiny", graph="optimized", device="cpu").graph == "optimized"  # named: served as named


def test_an_entry_exported_before_the_cpu_graph_serves_the_fused_graph(tiny_entry: Path, tmp_path: Path) -> None:
    _without_cpu_graph(tiny_entry, tmp_path)
    repo = ModelRepository(tmp_path)
    assert repo.entry("old", graph="auto", device="cpu").graph == "optimized"
    with pytest.raises(RepositoryError, match=r"model old version 1 has no 'optimized-cpu' graph \(has: fp32, optim"):
        repo.entry("old", graph="optimized-cpu", device="cpu")


def test_an_entry_without_the_cpu_graph_says_once_how_to_get_it(
    tiny_entry: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A repository exported before optimized-cpu keeps working; its user learns, once, what a new export gives."""
    caplog.set_level(logging.INFO, logger="mhaserve.runtime.repository")
    _without_cpu_graph(tiny_entry, tmp_path)
    repo = ModelRepository(tmp_path)
    for _ in range(3):  # the server's start-up check, the load, a reload
        repo.entry("old", graph="auto", device="cpu")
    said = [r.getMessage() for r in caplog.records if "has no optimized-cpu graph" in r.getMessage()]
    assert said == [
        "old version 1 has no optimized-cpu graph (exported before it existed): serving optimized on the CPU; "
        "`mhaserve export --optimize` writes a new version with it, about 1.1x the texts a second on a CPU"
    ]
    caplog.clear()
    ModelRepository(tiny_entry.parent.parent).entry("tiny", graph="auto", device="cpu")  # has it: nothing to say
    repo.entry("old", graph="optimized", device="cpu")  # asked for by name: nothing to say
    ModelRepository(tmp_path).entry("old", graph="auto", device="cuda")  # what CUDA serves anyway
    assert not [r for r in caplog.records if "optimized-cpu" in r.getMessage()]


def test_a_version_folder_not_written_as_its_number_is_not_a_version(tiny_entry: Path, tmp_path: Path) -> None:
    """`08` was counted as version 8 (the newest, for a `latest` policy) while its files were looked for in `8/`:
    a load failure naming a folder that does not exist, and `08` and `8` the same version."""
    for folder in ("2", "08", "0", "+3", " 4", str(2**63), "9" * 200):  # the last two past int64
        shutil.copytree(tiny_entry, tmp_path / "m" / folder)
    assert mf.versions(tmp_path, "m") == [2]
    assert ModelRepository(tmp_path).entry("m").version == 2


def test_folders_that_are_no_model_or_no_version_are_said_once(
    tiny_entry: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model published as `MiniLM/1/` or a version as `v1/` was left out with no word: each such folder is
    named once, with why; hidden folders (an export's scratch), lost+found and files pass without one."""
    for folder in ("MiniLM/1", "m/2", "m/v1", "m/0", "m/08", ".export-m-3-x/1", "lost+found/1"):
        shutil.copytree(tiny_entry, tmp_path / folder)
    (tmp_path / "README.md").write_text("models\n")
    (tmp_path / "m" / "serving.json").write_text("{}")
    caplog.set_level(logging.WARNING, logger="mhaserve.runtime.repository")
    repository = ModelRepository(tmp_path)
    for _ in range(2):  # every poll reads the repository again
        assert repository.names() == ["m"]
        assert repository.published("m") == [2]
    said = sorted(r.getMessage() for r in caplog.records)
    assert said == [
        f"ignoring {tmp_path / 'MiniLM'} in the model repository: not a model name (as 'minilm' it would be one): "
        "lower-case letters, digits, '.', '_' and '-'",
        *(
            f"ignoring {tmp_path / 'm' / v} in the model repository: not a version: versions are folders named by a "
            f"number from 1 to {2**63 - 1}, written as one (1, 2, 10)"
            for v in ("0", "08", "v1")
        ),
    ]


def test_a_named_model_says_which_of_its_folders_are_no_version(
    tiny_entry: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model served by name (not found by listing the repository) names its folders that are no version too:
    one published only as `v1/` is not in the repository, and the log says why."""
    shutil.copytree(tiny_entry, tmp_path / "m" / "v1")
    caplog.set_level(logging.WARNING, logger="mhaserve.runtime.repository")
    # its folder is there: it was "not in the repository (it has: ...)", with the folder in plain sight
    no_version = r"model 'm' has no version in the repository: its folder .* holds no version folder \(1/, 2/, \.+\)$"
    with pytest.raises(Exception, match=no_version):
        ModelRepository(tmp_path).published("m")
    assert [r.getMessage() for r in caplog.records] == [
        f"ignoring {tmp_path / 'm' / 'v1'} in the model repository: not a version: versions are folders named by a "
        f"number from 1 to {2**63 - 1}, written as one (1, 2, 10)"
    ]


def _copy(tiny_entry: Path, tmp_path: Path, **manifest: Any) -> tuple[Path, ModelRepository]:
    """A copy of the tiny version as model `m` version 1, its manifest's keys changed (None: removed)."""
    copy = tmp_path / "m" / "1"
    shutil.copytree(tiny_entry, copy)
    m = json.loads((copy / "manifest.json").read_text())
    for key, value in manifest.items():
        if value is None:
            del m[key]
        else:
            m[key] = value
    (copy / "manifest.json").write_text(json.dumps(m))
    return copy, ModelRepository(tmp_path)


def _no_engine(entry: object) -> object:
    raise AssertionError("the graph was opened")


def test_a_tokenizer_larger_than_the_vocabulary_its_manifest_says_is_refused_at_load(
    tiny_entry: Path, tmp_path: Path
) -> None:
    """A manifest whose vocab_size was edited below its tokenizer's (export refuses the pair): the version was
    served, and each text whose tokens passed that size was refused as the client's error, "token id ... is
    outside the vocabulary". The load now fails, saying why, before the graph opens."""
    _, repo = _copy(tiny_entry, tmp_path, vocab_size=50)
    with pytest.raises(RepositoryError, match=r"its tokenizer has 256 tokens, more than the vocab_size 50 its manif"):
        repo.load(repo.entry("m"), _no_engine)  # type: ignore[arg-type]


def test_a_tokenizer_that_cannot_be_read_is_named_at_load(tiny_entry: Path, tmp_path: Path) -> None:
    """A version exported before the tokenizer's sha256 was recorded, whose tokenizer.json is then broken: the
    load's error, in the log and the index, was the JSON parser's alone ("expected `,` or `}` at line 1 column
    11"), naming no file."""
    copy, repo = _copy(tiny_entry, tmp_path, tokenizer_sha256=None)
    (copy / "tokenizer.json").write_text('{"garbage": ')
    with pytest.raises(RepositoryError, match=rf"^{copy / 'tokenizer.json'} cannot be read as a tokenizer: .*line 1"):
        repo.load(repo.entry("m"), _no_engine)  # type: ignore[arg-type]


def test_a_prompt_that_leaves_no_room_for_a_text_is_refused_at_load(
    tiny_entry: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A serving.json whose prompt, with the special tokens, fills its max_length loaded without a word, and
    with truncation every text a request sent with it (the default prompt: every text) embedded as the prompt
    alone, all to one vector. One that leaves a token for the text loads."""
    _, repo = _copy(tiny_entry, tmp_path)
    config = tmp_path / "m" / "serving.json"
    config.write_text(json.dumps({"prompts": {"q": "a b c d"}, "max_length": 6, "default_prompt_name": "q"}))
    with pytest.raises(RepositoryError, match=r"prompt 'q' \('a b c d'\) with the special tokens fills max_length 6"):
        repo.load(repo.entry("m"), _no_engine)  # type: ignore[arg-type]
    config.write_text(json.dumps({"prompts": {"q": "a b c"}, "max_length": 6}))
    with pytest.raises(AssertionError, match="the graph was opened"):  # past the check
        repo.load(repo.entry("m"), _no_engine)  # type: ignore[arg-type]
    # one no request gets unless it names it: said, and loaded (a config that loaded before)
    config.write_text(json.dumps({"prompts": {"q": "a b c d"}, "max_length": 6}))
    with caplog.at_level(logging.WARNING), pytest.raises(AssertionError, match="the graph was opened"):
        repo.load(repo.entry("m"), _no_engine)  # type: ignore[arg-type]
    assert any("prompt 'q' ('a b c d') with the special tokens fills" in r.getMessage() for r in caplog.records)


def test_an_entry_s_digest_changes_with_what_it_computes_and_only_that(tiny_entry: Path) -> None:
    """GetModelInfo's digest, which `mhaserve encode` compares before and after its texts: another graph, other
    external data (a graph past 1.5 GB, whose sha256 covers the data file's name, not its weights), another
    tokenizer or a setting that shapes a vector is another copy; the version policy or the limits are not."""
    entry = ModelRepository(tiny_entry.parent.parent).entry("tiny", graph="fp32", device="cpu")
    fp32 = entry.manifest.graphs["fp32"]

    def graphs(**changes: Any) -> mf.Manifest:
        return dataclasses.replace(entry.manifest, graphs={"fp32": dataclasses.replace(fp32, **changes)})

    other = [
        dataclasses.replace(entry, graph="optimized"),
        dataclasses.replace(entry, manifest=graphs(sha256="0" * 64)),
        dataclasses.replace(entry, manifest=graphs(external_data={"model.onnx.data": "1" * 64})),
        dataclasses.replace(entry, manifest=dataclasses.replace(entry.manifest, tokenizer_sha256="2" * 64)),
        dataclasses.replace(entry, config=serving.ServingConfig(normalize=not entry.normalize)),
        dataclasses.replace(entry, config=serving.ServingConfig(max_length=entry.max_tokens - 1)),
        dataclasses.replace(entry, config=serving.ServingConfig(prompts={"q": "query: "})),
    ]
    digests = [e.digest for e in [entry, *other]]
    assert len(set(digests)) == len(digests), digests
    same = dataclasses.replace(
        entry,
        config=serving.ServingConfig(version_policy=serving.VersionPolicy(kind="all"), limits={"max_queue_size": 3}),
    )
    assert same.digest == entry.digest
