"""Exporting a small random model: the entry's files, the graph's contract, the gate, the CLI's errors."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from mhaserve.cli.main import EXPORT_HINT, main
from mhaserve.export import onnx_graph, staging
from mhaserve.export.publish import ExportError, ExportOptions, export_entry
from mhaserve.model.config import EncoderConfig
from mhaserve.model.encoder import Encoder, random_encoder
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.errors import InvalidArgument
from mhaserve.runtime.manifest import ManifestError, read_manifest, sha256_file, verify_graph
from tests.conftest import TINY
from tests.export.test_staging import signal_as_the_lock_is_made

GRID = [(b, s) for b in (1, 2, 3, 32) for s in (1, 2, 7, 128, TINY["max_seq_len"])]


def _padded_batch(batch: int, seq: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, seq + 1, size=batch)
    lengths[0] = seq
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    ids = rng.integers(0, TINY["vocab_size"], size=(batch, seq)) * mask
    return ids.astype(np.int64), mask


def test_entry_layout_and_manifest(tiny_entry: Path) -> None:
    assert tiny_entry.name == "1" and tiny_entry.parent.name == "tiny"
    m = read_manifest(tiny_entry)
    assert (m.name, m.version, m.hidden_size, m.layers, m.heads, m.ffn) == ("tiny", 1, 32, 2, 4, 64)
    assert (m.max_seq_len, m.vocab_size, m.pad_id, m.pooling, m.normalize) == (160, 256, 0, "mean", True)
    assert [i["name"] for i in m.inputs] == ["input_ids", "attention_mask"]
    assert m.outputs == [{"name": "embeddings", "dtype": "float32", "shape": ["batch", 32]}]
    assert set(m.graphs) == {"fp32", "optimized", "optimized-cpu", "fp16", "int8"}
    assert m.graphs["optimized"].optimized and m.graphs["fp16"].precision == "fp16"
    assert m.graphs["optimized-cpu"].optimized and m.graphs["optimized-cpu"].precision == "fp32"
    assert m.graphs["int8"].precision == "int8"
    assert m.exporter["torch"].startswith("2.13.0")
    for name, g in m.graphs.items():
        verify_graph(tiny_entry, g)
        assert g.parity["passed"] and g.parity["nodes"] == sum(g.parity["node_types"].values())
        if name == "int8":  # its own gate, against the fused fp32 graph (tests/export/test_int8.py)
            continue
        assert g.parity["max_abs_diff"] <= g.parity["tolerance"]
        assert len(g.parity["cases"]) == len(GRID)
    # no stray external-data file and no scratch directory left behind
    assert sorted(p.name for p in tiny_entry.iterdir()) == sorted(
        [
            "manifest.json",
            "tokenizer.json",
            "model.onnx",
            "model.optimized.onnx",
            "model.optimized-cpu.onnx",
            "model.fp16.onnx",
            "model.int8.onnx",
        ]
    )
    assert [p.name for p in tiny_entry.parent.parent.iterdir()] == ["tiny"]


VARIANTS = ["model.onnx", "model.optimized.onnx", "model.optimized-cpu.onnx", "model.fp16.onnx", "model.int8.onnx"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_graph_dims_are_symbolic_and_match_the_manifest(tiny_entry: Path, variant: str) -> None:
    g = onnx.load(str(tiny_entry / variant))
    m = read_manifest(tiny_entry)
    for vi in g.graph.input:
        dims = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
        assert all(isinstance(d, str) and d for d in dims), (vi.name, dims)
        assert vi.type.tensor_type.elem_type == onnx.TensorProto.INT64
    out = g.graph.output[0]
    assert out.name == "embeddings" and out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert out.type.tensor_type.shape.dim[1].dim_value == m.hidden_size
    assert next(o.version for o in g.opset_import if o.domain == "") == m.opset


@pytest.mark.parametrize("variant", VARIANTS)
def test_graph_carries_no_paths_of_the_checkout(tiny_entry: Path, variant: str) -> None:
    """The exporter's per-node stack traces would put this checkout's paths in the published graph (and make
    its sha256 depend on where the code lives)."""
    raw = (tiny_entry / variant).read_bytes()
    root = str(Path(__file__).resolve().parents[2]).encode()
    assert root not in raw
    assert b"stack_trace" not in raw
    assert b"namespace" in raw  # the module path of each node stays, for debugging


@pytest.mark.parametrize(("batch", "seq"), GRID)
def test_parity_eager_vs_onnx_runtime(tiny_entry: Path, batch: int, seq: int) -> None:
    """fp32 graph and fused graphs under plain ONNX Runtime vs the eager model: max abs diff <= 1e-5."""
    model = random_encoder(EncoderConfig(**TINY), seed=7)  # type: ignore[arg-type]
    ids, mask = _padded_batch(batch, seq, seed=batch * 1000 + seq)
    with torch.no_grad():
        want = model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    for graph in ("model.onnx", "model.optimized.onnx", "model.optimized-cpu.onnx"):
        sess = ort.InferenceSession(str(tiny_entry / graph), providers=["CPUExecutionProvider"])
        got = sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        assert got.shape == (batch, TINY["d_model"])
        assert np.abs(got - want).max() <= 1e-5, (graph, np.abs(got - want).max())


def test_padding_does_not_change_a_row_in_the_graph(tiny_entry: Path) -> None:
    sess = ort.InferenceSession(str(tiny_entry / "model.onnx"), providers=["CPUExecutionProvider"])
    ids, mask = _padded_batch(3, 50, seed=1)
    ids[1, 6:], mask[1, 6:] = 0, 0
    batched = sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    alone = sess.run(None, {"input_ids": ids[1:2, :6], "attention_mask": mask[1:2, :6]})[0]
    assert np.abs(batched[1] - alone[0]).max() <= 1e-6


def test_engine_refuses_what_the_graph_must_not_see(tiny_entry: Path) -> None:
    engine = OnnxEngine(tiny_entry / "model.onnx", max_seq_len=160, vocab_size=256, device="cpu")
    ok = np.ones((1, 160), dtype=np.int64)
    assert engine.run(ok, ok).shape == (1, 32)
    long = np.ones((1, 161), dtype=np.int64)
    with pytest.raises(InvalidArgument, match="161 exceeds the model's maximum of 160"):
        engine.run(long, long)
    with pytest.raises(InvalidArgument, match="token id 256 is outside"):
        engine.run(np.array([[1, 256]]), np.ones((1, 2), dtype=np.int64))
    with pytest.raises(InvalidArgument, match="token id -1"):
        engine.run(np.array([[1, -1]]), np.ones((1, 2), dtype=np.int64))
    with pytest.raises(InvalidArgument, match="one shape"):
        engine.run(np.ones((2, 3), dtype=np.int64), np.ones((2, 4), dtype=np.int64))


def test_tokenizer_is_configured_for_serving(tiny_entry: Path) -> None:
    spec = json.loads((tiny_entry / "tokenizer.json").read_text())
    assert spec["padding"] is None
    assert spec["truncation"]["max_length"] == 160
    assert read_manifest(tiny_entry).tokenizer_sha256 == sha256_file(tiny_entry / "tokenizer.json")


def test_corrupted_graph_fails_the_checksum(tiny_entry: Path, tmp_path: Path) -> None:
    m = read_manifest(tiny_entry)
    bad = tmp_path / "model.onnx"
    data = bytearray((tiny_entry / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="fails its checksum"):
        verify_graph(tmp_path, m.graphs["fp32"])


def test_a_graph_that_holds_its_weights_records_no_external_data(tiny_entry: Path) -> None:
    """No key at all, rather than {}: a server older than the key refuses a manifest that has it (an unknown
    key), and a graph that holds its tensors names no file, as its own sha256 vouches."""
    assert {v: g.external_data for v, g in read_manifest(tiny_entry).graphs.items()} == {
        v: None for v in ("fp32", "optimized", "optimized-cpu", "fp16", "int8")
    }
    written = json.loads((tiny_entry / "manifest.json").read_text())
    assert not any("external_data" in g for g in written["graphs"].values())


def test_a_random_models_manifest_says_how_to_make_it_again(tiny_entry: Path) -> None:
    """Its sizes are keys of the manifest already; the seed and the position encoding were nowhere, so a random
    model could not be exported again as it was (the source label carries them: a new key would make servers
    older than it refuse the manifest)."""
    assert read_manifest(tiny_entry).source == "random (seed 7, learned positions)"


def _tiny_opts(repo: Path, **kw: object) -> ExportOptions:
    return ExportOptions(source="random", repository=repo, name="t", random_config=dict(TINY), **kw)  # type: ignore[arg-type]


def test_a_graph_that_fails_parity_is_not_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph whose attention is scaled by sqrt(d_model) (the classic bug) must fail the gate."""
    real_export = onnx_graph.export_graph

    def wrongly_scaled(model: Encoder, path: Path) -> None:
        for layer in model.blocks():
            layer.attn.scale = 1.0 / model.cfg.d_model**0.5
        try:
            real_export(model, path)
        finally:
            for layer in model.blocks():
                layer.attn.scale = 1.0 / model.cfg.d_k**0.5

    monkeypatch.setattr(onnx_graph, "export_graph", wrongly_scaled)
    # larger weights than BERT's init, so that the scale matters well beyond the tolerance
    monkeypatch.setattr("model.encoder.init_weights.__defaults__", (0.2,))
    with pytest.raises(ExportError, match=r"parity gate failed for the fp32 graph: max abs diff .* tolerance 1e-05"):
        export_entry(_tiny_opts(tmp_path), out=io.StringIO())
    assert list(tmp_path.iterdir()) == []  # no entry, no scratch directory


def test_a_graph_that_answers_nan_fails_the_gate() -> None:
    """NaN compares false with every bound: a NaN row (an fp16 overflow, -inf in a mask) was recorded as no
    difference at all, and the gate passed it."""
    from mhaserve.export import parity

    cfg = EncoderConfig(**TINY)  # type: ignore[arg-type]
    model = random_encoder(cfg, seed=0).eval()

    class NanRows:
        providers = ["CPUExecutionProvider"]

        def run(self, ids: np.ndarray, mask: np.ndarray, *, beside: bool = False) -> np.ndarray:
            with torch.no_grad():
                out = model(torch.from_numpy(ids), torch.from_numpy(mask)).float().numpy()
            if len(out) > 1:
                out[-1] = np.nan  # a padded row
            return out

    report = parity.check(model, NanRows())
    assert not report.passed and report.max_abs_diff == float("inf") and report.min_cosine == -1.0
    with pytest.raises(parity.ParityError, match=r"max abs diff inf \(an output that is not a finite number\) "):
        parity.gate(model, NanRows(), variant="fp32")


def test_a_version_published_while_an_export_ran_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next free version is chosen at the start; one published meanwhile (another export, a copy) is
    refused at the end unless --overwrite, rather than silently replaced."""

    scratch, target = tmp_path / ".scratch", tmp_path / "m" / "1"
    scratch.mkdir()
    (scratch / "new").write_text("ours")
    target.mkdir(parents=True)
    (target / "marker").write_text("theirs")
    with pytest.raises(staging.PublishError, match="published by someone else while this export ran"):
        staging.publish(scratch, target)
    assert (target / "marker").exists() and scratch.exists()
    # --overwrite: the new version is in place before the old one is deleted (a polling server saw the
    # version missing for as long as the deletion took, and fell back to an older one or to nothing)
    seen_during_deletion: list[list[str]] = []
    real_rmtree = shutil.rmtree

    def rmtree(path: Path, ignore_errors: bool = False) -> None:
        seen_during_deletion.append(sorted(p.name for p in target.iterdir()))
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(staging.shutil, "rmtree", rmtree)
    staging.publish(scratch, target, overwrite=True)
    assert seen_during_deletion == [["new"]]
    assert [p.name for p in target.iterdir()] == ["new"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["1"]  # the old copy is gone


def test_a_repository_that_is_not_a_folder_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An OSError from the repository (a file where the folder goes) was a traceback; and import's
    --max-seq-len is refused by argparse below 2 (-4 was an OverflowError from the tokenizer)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    sizes = ["--layers", "1", "--d-model", "16", "--heads", "2", "--ffn", "32", "--max-positions", "16"]
    # The repository a file, or the model's folder in it: said before the export runs (it ran the whole export
    # and its gate first, then said "File exists").
    for repository, name in ((afile, "t"), (tmp_path, "afile")):
        args = ["export", "--source", "random", "--repository", str(repository), "--name", name, *sizes]
        assert main([*args, "--vocab-size", "128"]) == 1
        out, err = capsys.readouterr()
        assert err == f"mhaserve export: error: {afile} is a file, not a folder\n", err
        assert "exporting" not in out + err
    with pytest.raises(SystemExit) as e:
        main(["import", "--onnx", "g.onnx", "--tokenizer", "t.json", "--name", "n", "--max-seq-len", "-4"])
    assert e.value.code == 2 and "must be a whole number >= 2" in capsys.readouterr().err


def test_ctrl_c_during_an_export_is_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C (KeyboardInterrupt) while the graph is written: exit 130, one line, no traceback, and no
    scratch folder or entry left in the repository."""

    def interrupted(model: Encoder, path: Path) -> None:
        path.write_bytes(b"half a graph")
        raise KeyboardInterrupt

    monkeypatch.setattr(onnx_graph, "export_graph", interrupted)
    sizes = ["--layers", "1", "--d-model", "16", "--heads", "2", "--ffn", "32", "--max-positions", "16"]
    args = ["export", "--source", "random", "--repository", str(tmp_path), "--name", "t", *sizes, "--vocab-size", "128"]
    assert main(args) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "mhaserve export: interrupted" and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def _ctrl_c_in_torch_export(model: Encoder, path: Path) -> None:
    # torch.export reports a Ctrl-C that lands inside it as a failure of its own: a RuntimeError raised while
    # the KeyboardInterrupt was being handled
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise RuntimeError("Failed to export the model with torch.export.")  # noqa: B904


def _ctrl_c_in_an_extensions_import(*args: object, **kwargs: object) -> None:
    # pybind11's module init (onnxruntime's, imported on first use) turns a Ctrl-C into this ImportError
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as e:
        raise ImportError("initialization failed") from e


@pytest.mark.parametrize(
    ("target", "stand_in"),
    [
        ("mhaserve.export.onnx_graph.export_graph", _ctrl_c_in_torch_export),
        ("mhaserve.runtime.engine.OnnxEngine", _ctrl_c_in_an_extensions_import),
    ],
    ids=["torch.export", "parity gate"],
)
def test_ctrl_c_wrapped_by_a_library_is_still_ctrl_c(
    target: str,
    stand_in: object,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C as the parity gate began was "initialization failed is not installed ... pip install
    'mhaserve[export]'" (exit 2), and during torch.export "the ONNX export failed" (exit 1)."""
    monkeypatch.setattr(target, stand_in)
    sizes = ["--layers", "1", "--d-model", "16", "--heads", "2", "--ffn", "32", "--max-positions", "16"]
    args = ["export", "--source", "random", "--repository", str(tmp_path), "--name", "t", *sizes, "--vocab-size", "128"]
    assert main(args) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "mhaserve export: interrupted", err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    if target.endswith("export_graph"):  # the export itself says so, not only the command line
        with pytest.raises(KeyboardInterrupt):
            export_entry(_tiny_opts(tmp_path), out=io.StringIO())


def test_not_installed_is_said_only_of_a_missing_module_of_the_export_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fails(error: ImportError) -> None:
        def export_graph(model: Encoder, path: Path) -> None:
            raise error

        monkeypatch.setattr(onnx_graph, "export_graph", export_graph)

    sizes = ["--layers", "1", "--d-model", "16", "--heads", "2", "--ffn", "32", "--max-positions", "16"]
    args = ["export", "--source", "random", "--repository", str(tmp_path), "--name", "t", *sizes, "--vocab-size", "128"]
    fails(ModuleNotFoundError("No module named 'onnxscript'", name="onnxscript"))
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"mhaserve export: error: onnxscript is not installed; this command needs {EXPORT_HINT}", err
    # A module that is there and fails to load is no reason to install the extra.
    fails(ImportError("initialization failed"))
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mhaserve export: error:") and "initialization failed" in err, err
    assert "not installed" not in err
    assert list(tmp_path.iterdir()) == []


def test_versions_increment_and_existing_ones_are_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sizes = ["--layers", "1", "--d-model", "16", "--heads", "2", "--ffn", "32", "--max-positions", "16"]
    args = ["export", "--source", "random", "--repository", str(tmp_path), "--name", "t", *sizes, "--vocab-size", "128"]
    assert main(args) == 0
    assert main(args) == 0
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["1", "2"]
    assert main([*args, "--version", "1"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main([*args, "--version", "1", "--overwrite"]) == 0
    assert read_manifest(tmp_path / "t" / "2").max_seq_len == 16


@pytest.mark.parametrize(
    ("source", "message", "status"),
    [
        # a --source that is no path is a bad flag, said before anything is written (it exited 1, as a failed gate)
        ("/does/not/exist", "--source '/does/not/exist' is neither 'minilm', 'random', nor an existing checkpoint", 2),
        (".", "has no config.json", 1),  # a folder that is no checkpoint: what the export found
    ],
)
def test_cli_bad_source_is_one_clear_line(
    source: str, message: str, status: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repository = tmp_path / "repo"
    assert main(["export", "--source", source, "--repository", str(repository), "--name", "x"]) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mhaserve export: error:") and message in err[-1], err
    assert "Traceback" not in "\n".join(err)
    assert status == 1 or not repository.exists()


def test_a_source_that_is_a_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--source ckpt/config.json` began the export and failed at its first step, exit 1 (a review's finding): a
    checkpoint is a folder, which the flag must name, checked before anything is written as a missing one is."""
    config = tmp_path / "config.json"
    config.write_text("{}")
    repository = tmp_path / "repo"
    assert main(["export", "--source", str(config), "--repository", str(repository), "--name", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"mhaserve export: error: --source {str(config)!r} is a file: name the checkpoint's folder", err
    assert not repository.exists()


def test_a_checkpoint_folder_that_is_no_model_name_says_to_pass_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A usage error (exit 2), said before anything is written; and the name is the folder's as the user gave it:
    through a link (a Hugging Face cache's snapshot given a readable name), the link's name, not its target's
    (the model was published as the target's folder, `model` or a snapshot's hash, and the check passed)."""
    from mhaserve.model.checkpoint import default_source

    source = tmp_path / "My Model"
    shutil.copytree(default_source(), source)
    link = tmp_path / "Linked Model"
    link.symlink_to(default_source(), target_is_directory=True)  # a folder named `model`: a valid name
    for given, folder in ((str(source), "My Model"), (str(link), "Linked Model"), (f"{link}/", "Linked Model")):
        repository = tmp_path / "repo"
        assert main(["export", "--source", given, "--repository", str(repository)]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"invalid model name '{folder.lower()}'" in err and f"from the folder '{folder}': pass --name" in err
        assert not repository.exists()
    # `--source .` in a folder reached through the link: the shell's working directory ($PWD) names it, as
    # `pwd` does, where the process's own (getcwd) is the target's
    monkeypatch.chdir(link)
    monkeypatch.setenv("PWD", str(link))
    assert main(["export", "--source", ".", "--repository", str(tmp_path / "repo")]) == 2
    assert "from the folder 'Linked Model': pass --name" in capsys.readouterr().err


def test_sigterm_during_an_export_is_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM (`timeout`, `docker stop`, Kubernetes) while the graph is written: as Ctrl-C, one line and nothing
    left in the repository. It ended the process at once and left the export's scratch folder (a graph's worth
    of disk) until a later export swept it."""

    def terminated(model: Encoder, path: Path) -> None:
        path.write_bytes(b"half a graph")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs at the next bytecode; this is never reached

    def not_taken(signum: int, frame: object) -> None:
        raise AssertionError("the export left SIGTERM to the process's own handler")

    monkeypatch.setattr(onnx_graph, "export_graph", terminated)
    sizes = ["--layers", "1", "--d-model", "16", "--heads", "2", "--ffn", "32", "--max-positions", "16"]
    args = ["export", "--source", "random", "--repository", str(tmp_path), "--name", "t", *sizes, "--vocab-size", "128"]
    previous = signal.signal(signal.SIGTERM, not_taken)
    try:
        assert main(args) == 143  # 128 + SIGTERM, as the server's; Ctrl-C's is 130
        assert signal.getsignal(signal.SIGTERM) is not_taken  # given back once the command is done
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "mhaserve export: terminated" and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_sigterm_as_the_scratch_folder_is_made_is_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A SIGTERM held while the scratch folder is made is given to its handler after: it was raised as a Ctrl-C,
    and the export said "interrupted" (130) of a SIGTERM (the review)."""
    signal_as_the_lock_is_made(monkeypatch, signal.SIGTERM)
    sizes = ["--layers", "1", "--d-model", "16", "--heads", "2", "--ffn", "32", "--max-positions", "16"]
    args = ["export", "--source", "random", "--repository", str(tmp_path), "--name", "t", *sizes, "--vocab-size", "128"]
    assert main(args) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == "mhaserve export: terminated"
    assert list(tmp_path.iterdir()) == []


def test_an_ignored_sigterm_stays_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A SIGTERM the export was started ignoring (`trap '' TERM`, nohup-like supervisors) is not taken as Ctrl-C."""
    real = onnx_graph.export_graph

    def terminated(model: Encoder, path: Path) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        real(model, path)

    monkeypatch.setattr(onnx_graph, "export_graph", terminated)
    sizes = ["--layers", "1", "--d-model", "16", "--heads", "2", "--ffn", "32", "--max-positions", "16"]
    args = ["export", "--source", "random", "--repository", str(tmp_path), "--name", "t", *sizes, "--vocab-size", "128"]
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        assert main(args) == 0, capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (tmp_path / "t" / "1" / "manifest.json").is_file()


@pytest.mark.parametrize(
    ("sizes", "message", "status"),
    [
        # sizes no model can have: usage errors (tests/cli/test_commands.py has the rest)
        (["--heads", "0"], "--heads must be positive, got 0", 2),  # was a ZeroDivisionError
        (["--max-positions", "2"], "--max-positions must be at least 3", 2),  # was torch.export's traceback
        (["--vocab-size", str(10**13)], "the model cannot be built", 1),  # torch's allocation error
    ],
)
def test_impossible_random_sizes_are_one_line(
    sizes: list[str], message: str, status: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {"--layers": "1", "--d-model": "16", "--heads": "2", "--ffn": "32", "--max-positions": "16",
            "--vocab-size": "128"}  # fmt: skip
    base.update(dict(zip(sizes[::2], sizes[1::2], strict=True)))
    args = ["export", "--source", "random", "--repository", str(tmp_path), "--name", "t"]
    assert main([*args, *[x for kv in base.items() for x in kv]]) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mhaserve export: error:") and message in err[-1], err
    assert "Traceback" not in "\n".join(err)
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_size_options_without_random_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--repository", str(tmp_path), "--layers", "2"]) == 2
    # --seed too: it was ignored without a word for a checkpoint, whose weights are what they are
    assert main(["export", "--repository", str(tmp_path), "--seed", "3"]) == 2
    assert capsys.readouterr().err.endswith("error: --seed applies only to --source random\n")
    # the message names the flags given (it named "size options and --seed" whichever was)
    assert main(["export", "--repository", str(tmp_path), "--pooling", "cls", "--seed", "3"]) == 2
    assert capsys.readouterr().err.endswith("error: --pooling, --seed apply only to --source random\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_a_seed_torch_cannot_take_is_a_usage_error(
    seed: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Past 64 bits torch refused the seed as the export began ("Overflow when unpacking long long", exit 1),
    after the repository's folder was made; a usage error, exit 2, naming the flag, with nothing written."""
    with pytest.raises(SystemExit) as e:
        main(["export", "--source", "random", "--repository", str(tmp_path / "r"), "--seed", seed])
    assert e.value.code == 2
    assert "--seed: a whole number from 0 to 18446744073709551615" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_int8_and_fp16_graphs_past_the_external_data_threshold_are_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past 1.5 GB (here: any size) `--int8` failed: the quantiser was handed a staged copy of the fused graph
    that named model.onnx.data without the file beside it. The int8 and fp16 graphs now keep their weights in
    a data file of their own, listed with its sha256, and the server loads each."""
    monkeypatch.setattr(onnx_graph, "_EXTERNAL_DATA_BYTES", 0)
    entry = export_entry(_tiny_opts(tmp_path, int8=True, fp16=True, seed=7), out=io.StringIO())
    m = read_manifest(entry)
    for variant in ("int8", "fp16"):
        g = m.graphs[variant]
        data = f"{g.file}.data"
        assert g.external_data == {data: sha256_file(entry / data)}, variant
        verify_graph(entry, g)
    assert m.graphs["int8"].parity["min_cosine"] >= 0.98  # the int8 gate ran on it
    ids = np.array([[101, 7, 8, 102], [101, 9, 102, 0]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)

    def embed(variant: str) -> np.ndarray:
        graph = entry / m.graphs[variant].file
        return OnnxEngine(graph, max_seq_len=TINY["max_seq_len"], vocab_size=TINY["vocab_size"]).run(ids, mask)

    want = embed("fp32")
    for variant in ("int8", "fp16"):
        assert (embed(variant) * want).sum(axis=1).min() > 0.95, variant


def test_the_parity_grid_shrinks_its_batches_past_512_tokens() -> None:
    """The eager model holds batch x heads x length^2 scores: 32 rows at 2,048 positions took 4 GB for two
    heads. Up to 512 tokens the grid is the documented one; past it, each length is still checked, with
    fewer rows."""
    from mhaserve.export.parity import ATTENTION_BUDGET, grid

    assert grid(256) == [(b, s) for b in (1, 2, 3, 32) for s in (1, 2, 7, 128, 256)]
    assert (32, 512) in grid(512)
    long = grid(2048)
    assert {s for _, s in long} == {1, 2, 7, 128, 2048}
    assert all(b * s * s <= ATTENTION_BUDGET for b, s in long if b > 3) and (32, 128) in long


@pytest.mark.slow
def test_an_export_past_the_external_data_threshold_vouches_for_its_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past 1.5 GB (here: any size) the weights are written to model.onnx.data, and the fused graphs read theirs
    from that same file: each graph's entry names it with its sha256, and a weight changed there is refused."""
    monkeypatch.setattr(onnx_graph, "_EXTERNAL_DATA_BYTES", 0)
    entry = export_entry(_tiny_opts(tmp_path, optimize=True), out=io.StringIO())
    data = entry / "model.onnx.data"
    m = read_manifest(entry)
    want = {"model.onnx.data": sha256_file(data)}
    assert {v: g.external_data for v, g in m.graphs.items()} == {"fp32": want, "optimized": want, "optimized-cpu": want}
    for g in m.graphs.values():
        verify_graph(entry, g)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    for g in m.graphs.values():
        with pytest.raises(ManifestError, match=r"model\.onnx\.data of graph .* fails its checksum"):
            verify_graph(entry, g)
