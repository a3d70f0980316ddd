"""`mhaserve import`: an ONNX encoder with a last_hidden_state output, adapted, checked, served.

The graphs come from the project's own exporter (torch.onnx, dynamo) over the token states of a random
model, shaped as the Hub's `onnx/model.onnx` files are (a token_type_ids input, token states out), and
in the slow test from Hugging Face's BertModel through the TorchScript exporter, as optimum makes them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import openai
import pytest
import torch
from onnx import TensorProto

from mhaserve.cli.main import main
from mhaserve.export import parity, staging
from mhaserve.export.importer import ImportFailed, ImportOptions, import_entry
from mhaserve.model.config import TINY, EncoderConfig
from mhaserve.model.encoder import Encoder, random_encoder
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.manifest import read_manifest, sha256_file, verify_graph
from mhaserve.service.settings import Settings
from mhaserve.testing.loopback import WAIT, free_port
from mhaserve.testing.server import ServerThread
from tests.conftest import VARIED_TEXTS

TEXTS = [t for t in VARIED_TEXTS if t.strip()]


class HubStyle(torch.nn.Module):
    """Our encoder's token states behind the Hub's inputs: input_ids, attention_mask, token_type_ids."""

    def __init__(self, encoder: Encoder, *, honour_mask: bool = True) -> None:
        super().__init__()
        self.encoder, self.honour_mask = encoder, honour_mask

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        # Token types shift the ids, so the graph depends on them as a Hub graph's embeddings do:
        # only zeros give the native export's answers.
        mask = attention_mask if self.honour_mask else torch.ones_like(attention_mask)
        return self.encoder.token_states(input_ids + token_type_ids, mask)


def export_token_states(module: torch.nn.Module, path: Path, max_positions: int) -> Path:
    """The project's exporter path (torch.onnx, dynamo), with the Hub's names and a token-states output."""
    ids = torch.full((2, 3), 1, dtype=torch.long)
    batch = torch.export.Dim("batch", min=1)
    seq = torch.export.Dim("sequence", min=1, max=max_positions)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module.eval(),
            (ids, torch.ones_like(ids), torch.zeros_like(ids)),
            dynamo=True,
            input_names=["input_ids", "attention_mask", "token_type_ids"],
            output_names=["last_hidden_state"],
            dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 1: seq}),
            verbose=False,
        )
        assert program is not None
        program.save(str(path))
    return path


@pytest.fixture(scope="module")
def tiny_model() -> Encoder:
    """The weights of the `tiny_entry` export (random, seed 7)."""
    return random_encoder(EncoderConfig(**TINY), seed=7)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def hub_graph(tiny_model: Encoder, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_token_states(HubStyle(tiny_model), tmp_path_factory.mktemp("hub") / "model.onnx", 160)


def do_import(graph: Path, tiny_entry: Path, repo: Path, name: str = "imported", **kw: Any) -> Path:
    opts = ImportOptions(onnx=graph, tokenizer=tiny_entry / "tokenizer.json", name=name, repository=repo, **kw)
    return import_entry(opts, out=io.StringIO())


def engine(entry: Path, graph: str = "model.onnx") -> OnnxEngine:
    m = read_manifest(entry)
    return OnnxEngine(
        entry / graph, max_seq_len=m.max_seq_len, vocab_size=m.vocab_size, device="cpu", pooling=m.pooling
    )


def grid_diff(a: OnnxEngine, b: OnnxEngine, max_seq_len: int) -> float:
    """The largest difference between two engines over the parity grid (rows partly padding)."""
    rng = np.random.default_rng(3)
    worst = 0.0
    for batch, seq in parity.grid(max_seq_len):
        ids, mask = parity.make_batch(batch, seq, 256, 0, rng)
        worst = max(worst, float(np.abs(a.run(ids, mask) - b.run(ids, mask)).max()))
    return worst


def served(repo: Path, *models: str) -> ServerThread:
    return ServerThread(
        Settings(
            repository=repo,
            model=models,
            port=0,
            metrics_port=0,
            http_port=free_port(),
            device="cpu",
            intra_op_threads=1,
        )
    ).ready()


def grpc_vectors(channel: grpc.Channel, model: str, texts: list[str]) -> npt.NDArray[np.float32]:
    reply = pb_grpc.EncoderServiceStub(channel).Encode(
        pb.EncodeRequest(texts=texts, model=model, truncate=True), timeout=WAIT
    )
    return np.array([e.values for e in reply.embeddings], dtype=np.float32)


def test_an_imported_graph_is_served_and_equals_the_native_export(
    hub_graph: Path, tiny_entry: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(tiny_entry, repo / "tiny" / "1")
    entry = do_import(hub_graph, tiny_entry, repo, normalize=read_manifest(tiny_entry).normalize)

    m = read_manifest(entry)
    assert m.tokenizer_sha256 == sha256_file(entry / "tokenizer.json")
    assert (m.architecture, m.hidden_size, m.max_seq_len, m.max_positions, m.pooling) == (
        "imported",
        32,
        160,
        160,
        "mean",
    )
    assert m.outputs == [{"name": "embeddings", "dtype": "float32", "shape": ["batch", 32]}]
    assert m.graphs["fp32"].parity["token_type_ids"] == "zeros" and m.graphs["fp32"].parity["passed"]
    g = onnx.load(str(entry / "model.onnx"))
    assert [i.name for i in g.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in g.graph.output] == ["embeddings"]
    assert grid_diff(engine(entry), engine(tiny_entry), 160) <= 1e-5

    with served(repo, "tiny", "imported") as srv, srv.channel() as channel:
        native, imported = (grpc_vectors(channel, name, TEXTS) for name in ("tiny", "imported"))
        assert native.shape == imported.shape == (len(TEXTS), 32)
        assert np.abs(native - imported).max() <= 1e-5
        client = openai.OpenAI(base_url=srv.http_url + "/v1", api_key="-", max_retries=0)
        over_http = client.embeddings.create(model="imported", input=TEXTS, extra_body={"truncate": True})
        assert np.abs(np.array([d.embedding for d in over_http.data]) - native).max() <= 1e-5


def test_an_import_past_the_external_data_threshold_vouches_for_its_data(
    hub_graph: Path, tiny_entry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past 1.5 GB (here: any size) the adapted graph's weights are written to model.onnx.data: the manifest
    names it with its sha256, as it does the graph."""
    monkeypatch.setattr(staging, "EXTERNAL_DATA_BYTES", 0)
    entry = do_import(hub_graph, tiny_entry, tmp_path / "repo")
    graph = read_manifest(entry).graph("fp32")
    assert graph.external_data == {"model.onnx.data": sha256_file(entry / "model.onnx.data")}
    assert verify_graph(entry, graph) == entry / "model.onnx"


@pytest.mark.parametrize("big", [False, True], ids=["under 1.5 GB", "past 1.5 GB"])
def test_a_graph_whose_weights_are_in_dot_slash_model_onnx_data_imports(
    hub_graph: Path, tiny_entry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, big: bool
) -> None:
    """A graph saved with location="./model.onnx.data" (some converters write it so): the import reads its
    weights and writes them again, inside the graph or (past 1.5 GB) as model.onnx.data, which the published
    version's manifest vouches for."""
    source = tmp_path / "source" / "model.onnx"
    source.parent.mkdir()
    onnx.save_model(
        onnx.load(str(hub_graph)),
        str(source),
        save_as_external_data=True,
        location="./model.onnx.data",
        size_threshold=1024,
    )
    if big:
        monkeypatch.setattr(staging, "EXTERNAL_DATA_BYTES", 0)
    entry = do_import(source, tiny_entry, tmp_path / "repo")
    graph = read_manifest(entry).graph("fp32")
    assert graph.external_data == ({"model.onnx.data": sha256_file(entry / "model.onnx.data")} if big else None)
    assert verify_graph(entry, graph) == entry / "model.onnx"
    assert grid_diff(engine(entry), engine(tiny_entry), 160) <= 1e-5


def test_cls_pooling_in_the_graph_and_pooling_left_to_the_server(
    hub_graph: Path, tiny_entry: Path, tiny_model: Encoder, tmp_path: Path
) -> None:
    def states_of(ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        with torch.no_grad():
            return tiny_model.token_states(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()

    cls = do_import(hub_graph, tiny_entry, tmp_path, "cls", pooling="cls")
    rng = np.random.default_rng(0)
    ids, mask = parity.make_batch(3, 20, 256, 0, rng)
    assert np.abs(engine(cls).run(ids, mask) - states_of(ids, mask)[:, 0]).max() <= 1e-5

    # --no-pooling: the graph keeps its token states and the server pools them (mean, here)
    raw = do_import(hub_graph, tiny_entry, tmp_path, "raw", pool_in_graph=False)
    assert [o.name for o in onnx.load(str(raw / "model.onnx")).graph.output] == ["last_hidden_state"]
    assert read_manifest(raw).outputs[0]["shape"] == ["batch", "sequence", 32]
    assert grid_diff(engine(raw), engine(tiny_entry), 160) <= 1e-5
    with served(tmp_path, "cls", "raw") as srv, srv.channel() as channel:
        cls_vectors, raw_vectors = (grpc_vectors(channel, name, TEXTS) for name in ("cls", "raw"))
        assert cls_vectors.shape == raw_vectors.shape == (len(TEXTS), 32)
        assert not np.allclose(cls_vectors, raw_vectors)  # CLS and mean pooling differ
        tok = read_manifest(raw)
        assert tok.pooling == "mean"


def test_the_sentence_transformers_files_beside_the_tokenizer_set_the_defaults(
    hub_graph: Path, tiny_entry: Path, tmp_path: Path
) -> None:
    hub = tmp_path / "hub"
    (hub / "1_Pooling").mkdir(parents=True)
    shutil.copy(tiny_entry / "tokenizer.json", hub / "tokenizer.json")
    (hub / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
    (hub / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    (hub / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Normalize"}]))
    opts = ImportOptions(onnx=hub_graph, tokenizer=hub / "tokenizer.json", name="st", repository=tmp_path / "repo")
    m = read_manifest(import_entry(opts, out=io.StringIO()))
    assert (m.max_seq_len, m.max_positions, m.pooling, m.normalize) == (64, 160, "cls", True)


def _edited(src: Path, dst: Path, edit: Callable[[onnx.ModelProto], None]) -> Path:
    g = onnx.load(str(src))
    edit(g)
    onnx.save(g, str(dst))
    return dst


def _freeze_batch(g: onnx.ModelProto) -> None:
    g.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1


def _int32_ids(g: onnx.ModelProto) -> None:
    g.graph.input[0].type.tensor_type.elem_type = TensorProto.INT32


def _position_ids_input(g: onnx.ModelProto) -> None:
    g.graph.input.append(onnx.helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["b", "s"]))


def _no_mask(g: onnx.ModelProto) -> None:
    g.graph.input[1].name = "mask"


def _as_sequence(vi: onnx.ValueInfoProto) -> None:
    vi.CopyFrom(onnx.helper.make_tensor_sequence_value_info(vi.name, TensorProto.FLOAT, None))


def _output_without_dtype(g: onnx.ModelProto) -> None:
    g.graph.output[0].type.tensor_type.elem_type = TensorProto.UNDEFINED


def _sequence_output(g: onnx.ModelProto) -> None:
    _as_sequence(g.graph.output[0])


def _ids_without_dtype(g: onnx.ModelProto) -> None:
    g.graph.input[0].type.tensor_type.elem_type = TensorProto.UNDEFINED


def _sequence_mask(g: onnx.ModelProto) -> None:
    _as_sequence(g.graph.input[1])


def _token_types_without_dtype(g: onnx.ModelProto) -> None:
    g.graph.input[2].type.tensor_type.elem_type = TensorProto.UNDEFINED


@pytest.mark.parametrize(
    ("edit", "kw", "message"),
    [
        (_freeze_batch, {}, "both must be symbolic"),
        (_int32_ids, {}, "the server feeds int64"),
        (_position_ids_input, {}, "unsupported: ['position_ids']"),
        (_no_mask, {}, "missing ['attention_mask']"),
        (None, {"output": "pooler_output"}, "no output 'pooler_output'"),
        # a type the graph does not declare, or not a tensor at all, was a KeyError traceback
        (_output_without_dtype, {}, "output last_hidden_state has no dtype (elem_type 0); token states are"),
        (_sequence_output, {}, "output last_hidden_state is a sequence, not a tensor; token states are"),
        (_ids_without_dtype, {}, "graph input input_ids has no dtype (elem_type 0); the server feeds int64"),
        (_sequence_mask, {}, "graph input attention_mask is a sequence, not a tensor; the server feeds int64"),
        (_token_types_without_dtype, {}, "graph input token_type_ids has no dtype (elem_type 0)"),
        (None, {"max_seq_len": 200}, "past the graph's 160 positions"),
    ],
)
def test_a_graph_outside_the_contract_is_refused_and_nothing_is_published(
    hub_graph: Path,
    tiny_entry: Path,
    tmp_path: Path,
    edit: Callable[[onnx.ModelProto], None] | None,
    kw: dict[str, Any],
    message: str,
) -> None:
    graph = _edited(hub_graph, tmp_path / "edited.onnx", edit) if edit else hub_graph
    repo = tmp_path / "repo"
    with pytest.raises(ImportFailed, match=re.escape(message)):
        do_import(graph, tiny_entry, repo, **kw)
    assert not repo.exists() or list(repo.rglob("*")) == [], "a refused import leaves the repository as it was"


def test_an_output_without_a_dtype_is_one_line(
    hub_graph: Path, tiny_entry: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    graph = _edited(hub_graph, tmp_path / "untyped.onnx", _output_without_dtype)
    args = ["import", "--onnx", str(graph), "--tokenizer", str(tiny_entry / "tokenizer.json"), "--name", "u"]
    assert main([*args, "--repository", str(tmp_path / "repo")]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("mhaserve import: error: output last_hidden_state has no dtype"), err
    assert "Traceback" not in err


def _rename(g: onnx.ModelProto, old: str, new: str) -> None:
    for node in g.graph.node:
        node.input[:] = [new if n == old else n for n in node.input]
        node.output[:] = [new if n == old else n for n in node.output]
    for o in g.graph.output:
        if o.name == old:
            o.name = new


def _output_named_embeddings(g: onnx.ModelProto) -> None:
    _rename(g, "last_hidden_state", "embeddings")


def _inner_tensor_named_embeddings(g: onnx.ModelProto) -> None:
    outputs = {o.name for o in g.graph.output}
    _rename(g, next(n.output[0] for n in g.graph.node if n.output[0] not in outputs), "embeddings")


@pytest.mark.parametrize(
    ("edit", "output"),
    [(_output_named_embeddings, "embeddings"), (_inner_tensor_named_embeddings, "last_hidden_state")],
    ids=["output", "inner tensor"],
)
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_token_states_named_embeddings_are_pooled_into_embeddings(
    hub_graph: Path,
    tiny_entry: Path,
    tmp_path: Path,
    edit: Callable[[onnx.ModelProto], None],
    output: str,
    pooling: str,
) -> None:
    """A graph with a tensor named `embeddings`, the pooled output's name, was refused as not in SSA form
    ("'embeddings' has been used as output names multiple times"): it imported only with --no-pooling."""
    graph = _edited(hub_graph, tmp_path / "named.onnx", edit)
    pooled = do_import(graph, tiny_entry, tmp_path, "pooled", output=output, pooling=pooling)
    assert [o.name for o in onnx.load(str(pooled / "model.onnx")).graph.output] == ["embeddings"]
    assert read_manifest(pooled).outputs == [{"name": "embeddings", "dtype": "float32", "shape": ["batch", 32]}]

    # pooled outside the graph: the token states of the graph as it came, run as they are, then numpy
    raw = do_import(hub_graph, tiny_entry, tmp_path, "raw", pool_in_graph=False)
    session = ort.InferenceSession(str(raw / "model.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for batch, seq in [(1, 1), (3, 20), (4, 160)]:
        ids, mask = parity.make_batch(batch, seq, 256, 0, rng)
        (states,) = session.run(None, {"input_ids": ids, "attention_mask": mask})
        mean = (states * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
        expected = states[:, 0] if pooling == "cls" else mean
        assert np.abs(engine(pooled).run(ids, mask) - expected).max() <= 1e-5


def test_a_graph_that_ignores_the_mask_fails_the_padding_check(
    tiny_model: Encoder, tiny_entry: Path, tmp_path: Path
) -> None:
    graph = export_token_states(HubStyle(tiny_model, honour_mask=False), tmp_path / "maskless.onnx", 160)
    with pytest.raises(ImportFailed, match="does not honour attention_mask; nothing was published"):
        do_import(graph, tiny_entry, tmp_path / "repo")
    assert list((tmp_path / "repo").rglob("*")) == []


def test_the_command_line(
    hub_graph: Path, tiny_entry: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["import", "--onnx", str(hub_graph), "--tokenizer", str(tiny_entry / "tokenizer.json"), "--name", "cli"]
    assert main([*args, "--repository", str(tmp_path), "--no-normalize"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli" / "1")
    assert main([*args, "--repository", str(tmp_path), "--version", "1"]) == 1
    assert "already exists" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a usage error, refused before anything is read (once exit 1)
        main([*args[:-1], "Bad/Name", "--repository", str(tmp_path)])
    assert e.value.code == 2 and "invalid model name" in capsys.readouterr().err
    for version in ("0", str(2**63)):  # past an int64 the server reads the folder as no version: refused before
        with pytest.raises(SystemExit) as e:
            main([*args, "--repository", str(tmp_path), "--version", version])
        assert e.value.code == 2 and "a version is a whole number from 1 to" in capsys.readouterr().err


def test_refused_sentence_transformers_files_are_one_line_and_flags_stand_in_for_them(
    hub_graph: Path, tiny_entry: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Dense module or an unsupported pooling beside the tokenizer ended `mhaserve import` in a traceback, and the
    flags that set what those files would have said could not get past them."""
    hub = tmp_path / "hub"
    (hub / "1_Pooling").mkdir(parents=True)
    shutil.copy(tiny_entry / "tokenizer.json", hub / "tokenizer.json")
    (hub / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "max"}))
    args = ["import", "--onnx", str(hub_graph), "--tokenizer", str(hub / "tokenizer.json"), "--name", "st"]
    assert main([*args, "--repository", str(tmp_path / "repo")]) == 1
    err = capsys.readouterr().err.splitlines()[-1]  # after the progress lines (a traceback would have raised)
    assert err.startswith("mhaserve import: error: unsupported pooling") and "--max-seq-len" in err, err
    overrides = ["--pooling", "cls", "--no-normalize", "--max-seq-len", "64"]
    assert main([*args, "--repository", str(tmp_path / "repo"), *overrides]) == 0
    m = read_manifest(Path(capsys.readouterr().out.strip()))
    assert (m.max_seq_len, m.pooling, m.normalize) == (64, "cls", False)


def test_ctrl_c_wrapped_by_a_library_is_still_ctrl_c_and_only_a_missing_module_is_not_installed(
    hub_graph: Path,
    tiny_entry: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C while onnxruntime's extension initialised (pybind11 raises ImportError("initialization failed")
    from the KeyboardInterrupt) was "initialization failed is not installed ... pip install 'mhaserve[export]'"."""
    error: ImportError = ImportError()

    def load(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr("mhaserve.runtime.engine.OnnxEngine", load)
    args = ["import", "--onnx", str(hub_graph), "--tokenizer", str(tiny_entry / "tokenizer.json"), "--name", "i"]
    args += ["--repository", str(tmp_path)]
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as e:
        error = ImportError("initialization failed")
        error.__cause__ = e
    assert main(args) == 130
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "mhaserve import: interrupted" and "Traceback" not in err, err

    # the import as a whole: inside it, ONNX Runtime's own errors are the graph's (its step says "cannot run")
    monkeypatch.setattr("mhaserve.export.importer.import_entry", load)
    error = ModuleNotFoundError("No module named 'torch'", name="torch")
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("mhaserve import: error: torch is not installed;")
    error = ImportError("initialization failed")
    assert main(args) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("mhaserve import: error:") and "initialization failed" in err and "not installed" not in err
    assert list(tmp_path.rglob("*")) == []


def test_a_file_that_is_not_an_onnx_graph_is_one_line(
    tiny_entry: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """onnx reads a .json file as JSON protobuf, whose error listed the message's fields on further lines."""
    tokenizer = str(tiny_entry / "tokenizer.json")
    assert (
        main(["import", "--onnx", tokenizer, "--tokenizer", tokenizer, "--name", "n", "--repository", str(tmp_path)])
        == 1
    )
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("mhaserve import: error:") and "is not an ONNX model" in err, err
    assert err.splitlines()[-2].startswith("[1/5] reading"), err


@pytest.mark.slow
def test_a_hugging_face_bert_graph_passes_the_parity_gate_and_serves_as_the_native_export(
    minilm_entry: Path, tmp_path: Path
) -> None:
    """BertModel (transformers) through the TorchScript exporter, as optimum and the Hub's onnx/ files are made."""
    from transformers import BertModel

    from mhaserve.model.checkpoint import default_source

    src = default_source()
    hub = tmp_path / "hub"
    (hub / "onnx").mkdir(parents=True)
    for f in ("tokenizer.json", "sentence_bert_config.json", "modules.json"):
        shutil.copy(src / f, hub / f)
    shutil.copytree(src / "1_Pooling", hub / "1_Pooling")

    class Hub(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = BertModel.from_pretrained(str(src), attn_implementation="eager")

        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state, out.pooler_output

    ids = torch.full((2, 3), 101, dtype=torch.long)
    axes = {0: "batch_size", 1: "sequence_length"}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Hub().eval(),
            (ids, torch.ones_like(ids), torch.zeros_like(ids)),
            str(hub / "onnx" / "model.onnx"),
            dynamo=False,
            input_names=["input_ids", "attention_mask", "token_type_ids"],
            output_names=["last_hidden_state", "pooler_output"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes, "last_hidden_state": axes},
            opset_version=14,
        )

    repo = tmp_path / "repo"
    shutil.copytree(minilm_entry, repo / "all-minilm-l6-v2" / "1")
    opts = ImportOptions(
        onnx=hub / "onnx" / "model.onnx", tokenizer=hub / "tokenizer.json", name="hub", repository=repo, reference=src
    )
    m = read_manifest(import_entry(opts, out=io.StringIO()))
    assert (m.max_seq_len, m.max_positions, m.pooling, m.normalize, m.layers) == (256, 512, "mean", True, 6)
    assert m.graphs["fp32"].parity["max_abs_diff"] <= 1e-5

    with served(repo, "all-minilm-l6-v2", "hub") as srv, srv.channel() as channel:
        native, imported = (grpc_vectors(channel, name, VARIED_TEXTS) for name in ("all-minilm-l6-v2", "hub"))
        assert np.abs(native - imported).max() <= 1e-5

    # A cased tokenizer of the same vocabulary passed the gate (which feeds ids, not text), and served every
    # capital as [UNK]: it is compared with the reference's own tokenizer now.
    cased = json.loads((src / "tokenizer.json").read_text())
    cased["normalizer"]["lowercase"] = False
    (hub / "cased.json").write_text(json.dumps(cased))
    opts = dataclasses.replace(opts, tokenizer=hub / "cased.json", name="cased")
    with pytest.raises(ImportFailed, match="does not tokenise as the reference's tokenizer.json: 'The Quick"):
        import_entry(opts, out=io.StringIO())
    assert not (repo / "cased").exists()


class RobertaStyle(torch.nn.Module):
    """Token states whose positions are numbered from the non-pad tokens with RoBERTa's offset (padding_idx
    1: the first real token at row 2), so its 162-row position table serves 160 tokens."""

    def __init__(self, pad_id: int) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.pad_id = pad_id
        self.tokens, self.positions = torch.nn.Embedding(256, 16), torch.nn.Embedding(162, 16)
        self.types = torch.nn.Embedding(1, 16)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        real = (input_ids != self.pad_id).long()
        positions = torch.cumsum(real, dim=1) * real + 1
        return self.tokens(input_ids) + self.positions(positions) + self.types(token_type_ids)


def test_a_graph_that_offsets_its_positions_is_served_the_positions_it_has(tiny_entry: Path, tmp_path: Path) -> None:
    """RoBERTa numbers positions from padding_idx + 1: a 514-row table takes 512 tokens. The import's run at
    full length fed only pad ids, which never reach the table's end: it published 514, and every long text
    then failed INTERNAL (a Gather out of range)."""
    from tokenizers import Tokenizer

    pad_id = Tokenizer.from_file(str(tiny_entry / "tokenizer.json")).token_to_id("[PAD]") or 0
    graph = export_token_states(RobertaStyle(pad_id), tmp_path / "roberta.onnx", 162)
    entry = do_import(graph, tiny_entry, tmp_path / "repo", name="roberta")
    m = read_manifest(entry)
    assert m.max_seq_len == 160
    ids = np.full((1, 160), (pad_id + 1) % 256, dtype=np.int64)
    assert engine(entry).run(ids, np.ones_like(ids)).shape == (1, 16)
    # named by hand past what the table holds: refused at the import, not at the first long request
    with pytest.raises(ImportFailed, match="cannot run the adapted graph at 162 tokens"):
        do_import(graph, tiny_entry, tmp_path / "repo", name="roberta2", max_seq_len=162)
