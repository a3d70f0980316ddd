"""What a request or a model file can make the server touch: no path from a request's model name, no
graph whose sha256 differs from its manifest, nothing unpickled or evaluated."""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.proto.inference.v2 import grpc_service_pb2 as kpb
from mhaserve.proto.inference.v2 import grpc_service_pb2_grpc as kpb_grpc
from mhaserve.runtime import manifest as mf
from mhaserve.runtime.errors import NotFound
from mhaserve.runtime.repository import ModelRepository, RepositoryError
from mhaserve.service.server import StartupError
from mhaserve.service.settings import Settings
from mhaserve.testing.loopback import WAIT
from mhaserve.testing.process import ServerProcess
from mhaserve.testing.server import ServerThread
from tests.runtime.test_digests import flip_keeping_times, settled
from tests.runtime.test_manifest import reading_from, with_external_data

ROOT = Path(__file__).resolve().parents[2]
# Names that would walk out of a repository if they were ever joined to a path.
HOSTILE = [
    "tiny\n",  # `$` in the name pattern let a final newline through
    "../tiny",
    "..",
    "../../../../etc/passwd",
    "/etc/passwd",
    "tiny/../../secrets",
    "tiny/1/../../../x",
    "tiny\x00",
    "\x00../etc",
    "\u2024\u2024/etc",  # one-dot leaders: not dots, but a normaliser might make them so
    "\uff0e\uff0e/etc",  # fullwidth full stops
    "%2e%2e%2fetc",
    "..\\..\\windows",
    "~root/.ssh",
    "TINY",
    "tiny ",
    "t" * 10_000,
]


class Watch:
    """Records every file the process opens or lists, and every repository function called, while on."""

    def __init__(self) -> None:
        self.on = False
        self.touched: list[str] = []
        self.lock = threading.Lock()

    def record(self, what: str) -> None:
        if self.on:
            with self.lock:
                self.touched.append(what)

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        if self.on and event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], str | Path):
            self.record(f"{event} {args[0]}")


@pytest.fixture(scope="module")
def watch() -> Iterator[Watch]:
    w = Watch()
    sys.addaudithook(w.audit)  # audit hooks cannot be removed; `on` keeps it quiet outside these tests
    yield w
    w.on = False


@pytest.fixture
def spied(watch: Watch, monkeypatch: pytest.MonkeyPatch) -> Watch:
    def spy(owner: Any, name: str) -> None:
        real: Callable[..., Any] = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            watch.record(f"{name}{args!r}")
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in ("versions", "models", "entry_dir", "read_manifest", "verify_graph", "check_name"):
        spy(mf, name)
    spy(ModelRepository, "entry")
    spy(Path, "stat")
    watch.touched.clear()
    return watch


@pytest.fixture(scope="module")
def server(tiny_repo: Path) -> Iterator[ServerThread]:
    with ServerThread(
        Settings(repository=tiny_repo, port=0, metrics_port=0, http_port=0, device="cpu", intra_op_threads=1)
    ) as s:
        yield s.ready()


def model_calls(channel: grpc.Channel, name: str) -> dict[str, Callable[[], Any]]:
    enc = pb_grpc.EncoderServiceStub(channel)
    inf = kpb_grpc.GRPCInferenceServiceStub(channel)
    text = kpb.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append(b"hi")
    return {
        "Encode": lambda: enc.Encode(pb.EncodeRequest(model=name, texts=["hi"]), timeout=WAIT),
        "EncodeStream": lambda: list(enc.EncodeStream(iter([pb.EncodeRequest(model=name, texts=["hi"])]))),
        "GetModelInfo": lambda: enc.GetModelInfo(pb.GetModelInfoRequest(model=name), timeout=WAIT),
        "ModelInfer": lambda: inf.ModelInfer(kpb.ModelInferRequest(model_name=name, inputs=[text]), timeout=WAIT),
        "ModelStreamInfer": lambda: list(
            inf.ModelStreamInfer(iter([kpb.ModelInferRequest(model_name=name, inputs=[text])]), timeout=WAIT)
        ),
        "ModelMetadata": lambda: inf.ModelMetadata(kpb.ModelMetadataRequest(name=name), timeout=WAIT),
        "ModelConfig": lambda: inf.ModelConfig(kpb.ModelConfigRequest(name=name), timeout=WAIT),
        "ModelStatistics": lambda: inf.ModelStatistics(kpb.ModelStatisticsRequest(name=name), timeout=WAIT),
        "ModelReady": lambda: inf.ModelReady(kpb.ModelReadyRequest(name=name), timeout=WAIT),
    }


def outcome(call: Callable[[], Any]) -> str:
    try:
        result = call()
    except grpc.RpcError as e:
        return str(e.code().name)
    if isinstance(result, list):  # a stream: its one response's error
        (response,) = result
        if isinstance(response, pb.EncodeResponse):
            return grpc.StatusCode.NOT_FOUND.name if response.error.code == 5 else f"code {response.error.code}"
        return response.error_message.split(":")[0] or "OK"
    if isinstance(result, kpb.ModelReadyResponse):
        return "ready" if result.ready else "not ready"
    return "OK"


@pytest.mark.parametrize("name", HOSTILE, ids=[ascii(n)[:24] for n in HOSTILE])
def test_a_model_name_from_a_request_never_reaches_the_filesystem(
    server: ServerThread, spied: Watch, name: str
) -> None:
    with server.channel() as channel:
        calls = model_calls(channel, name)
        spied.on = True
        try:
            outcomes = {method: outcome(call) for method, call in calls.items()}
        finally:
            spied.on = False
    expected = {method: "NOT_FOUND" for method in calls} | {"ModelReady": "not ready"}
    assert outcomes == expected
    assert spied.touched == [], "a request's model name led to file access"
    with server.channel() as channel:  # and the server goes on
        assert pb_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(texts=["hi"]), timeout=WAIT).embeddings


@pytest.mark.parametrize("name", HOSTILE[:12])
def test_a_hostile_model_name_at_start_up_is_refused_before_any_path_is_built(
    tiny_repo: Path, spied: Watch, name: str
) -> None:
    repository = ModelRepository(tiny_repo)
    spied.on = True
    try:
        with pytest.raises(NotFound, match="invalid model name"):
            repository.entry(name)
    finally:
        spied.on = False
    assert any(t.startswith("check_name") for t in spied.touched)  # the watch does see calls
    assert all(not t.startswith(("open", "os.", "stat", "entry_dir", "read_manifest")) for t in spied.touched)


@pytest.fixture
def tampered(tiny_entry: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model whose graphs were changed after the manifest vouched for them."""
    entry = tmp_path / "repo" / "tiny" / "1"
    shutil.copytree(tiny_entry, entry)
    for graph in entry.glob("*.onnx"):
        with graph.open("ab") as f:
            f.write(b"\x00")
    return tmp_path / "repo"


def test_a_graph_that_fails_its_sha256_is_never_loaded(tampered: Path) -> None:
    loaded: list[object] = []

    def factory(entry: Any) -> Any:
        loaded.append(entry)
        raise AssertionError("the engine was built for a tampered graph")

    settings = Settings(repository=tampered, port=0, metrics_port=0, http_port=0, device="cpu")
    for graph in ("auto", "fp32", "fp16"):
        with pytest.raises(StartupError, match="fails its checksum"):
            ServerThread(Settings(**{**settings.__dict__, "graph": graph}), factory)
    assert loaded == []


@pytest.mark.parametrize("location", ["model.onnx.data", "./model.onnx.data"])
def test_a_graph_whose_external_data_fails_its_sha256_is_never_loaded(
    tiny_entry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, location: str
) -> None:
    """A graph past 1.5 GB keeps every weight in model.onnx.data: weights changed there, model.onnx and the
    manifest as they were, were served (other vectors, no error). They are refused as a changed graph is, even
    with the file's size and modification time kept, after a server of this process checked it (its digest
    remembered: runtime/digests.py). A graph that names the file `./model.onnx.data` (onnx.save writes it as a
    converter spells it) reads the same file, and is served and checked alike."""
    entry = with_external_data(tiny_entry, tmp_path / "repo" / "tiny" / "1", location=location)
    settled(monkeypatch)
    settings = Settings(repository=tmp_path / "repo", port=0, metrics_port=0, http_port=0, device="cpu")
    with ServerThread(settings).ready() as srv, srv.channel() as channel:  # intact, it is served
        assert pb_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(texts=["hi"]), timeout=WAIT).embeddings
    flip_keeping_times(entry / "model.onnx.data")
    loaded: list[object] = []

    def factory(entry: Any) -> Any:
        loaded.append(entry)
        raise AssertionError("the engine was built for a graph whose weights were tampered with")

    with pytest.raises(StartupError, match=r"external data .*model\.onnx\.data of graph .* fails its checksum"):
        ServerThread(settings, factory)
    assert loaded == []


@pytest.mark.parametrize("location", ["../model.onnx.data", "sub/../model.onnx.data", "./sub/model.onnx.data"])
def test_a_graph_that_reads_outside_its_folder_is_never_loaded(tiny_entry: Path, tmp_path: Path, location: str) -> None:
    """A tensor's location is a plain file name of the version's folder, a leading `./` aside: any other path
    is refused before ONNX Runtime opens it, even one that reaches bytes the manifest vouches for (a folder
    `sub` may be a link elsewhere, whose `..` is its target's parent)."""
    entry = with_external_data(tiny_entry, tmp_path / "repo" / "tiny" / "1")
    reading_from(entry, location)
    loaded: list[object] = []

    def factory(entry: Any) -> Any:
        loaded.append(entry)
        raise AssertionError("the engine was built for a graph that reads outside its folder")

    settings = Settings(repository=tmp_path / "repo", port=0, metrics_port=0, http_port=0, device="cpu")
    with pytest.raises(StartupError, match=f"reads external data {re.escape(repr(location))}, which is no plain"):
        ServerThread(settings, factory)
    assert loaded == []


def test_a_tokenizer_that_fails_its_sha256_is_never_loaded(tiny_entry: Path, tmp_path: Path) -> None:
    """Another tokenizer.json gives other ids, so other vectors, and no error anywhere: it is checked as the
    graphs are. A manifest written before the tokenizer's sha256 was recorded still loads (unchecked)."""
    entry = tmp_path / "repo" / "tiny" / "1"
    shutil.copytree(tiny_entry, entry)
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["tokenizer_sha256"]
    tokenizer = entry / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + "\n")  # still a valid tokenizer, not the one vouched for
    repository = ModelRepository(tmp_path / "repo")
    with pytest.raises(RepositoryError, match="tokenizer .* fails its checksum"):
        repository.entry()
    (entry / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "tokenizer_sha256"}))
    assert repository.entry().tokenizer_path == tokenizer


@pytest.mark.slow
def test_serve_exits_1_on_a_tampered_graph(tampered: Path, tmp_path: Path) -> None:
    flags = ["--repository", str(tampered), "--port", "0", "--metrics-port", "0", "--http-port", "0", "--device", "cpu"]
    with ServerProcess(flags, tmp_path / "serve.log") as proc:
        assert proc.wait(WAIT) == 1
        assert "fails its checksum" in proc.log and "Traceback" not in proc.log


# Modules the server runs, and what they must never call on bytes from a request or a model file.
SERVING_CODE = sorted((ROOT / "service").rglob("*.py")) + sorted((ROOT / "runtime").rglob("*.py"))
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "joblib", "marshal", "shelve", "cloudpickle", "torch"}
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_METHODS = {"register_custom_ops_library", "loads"}  # custom ORT ops are native code; loads: pickle & co
# What may call a method named load or loads: JSON parsers, and uvicorn's Config.load (it builds the SSL
# context and the protocol classes from the server's own settings; it reads no data).
SAFE_LOADERS = ("json", "orjson", "self.config")


@pytest.mark.parametrize("path", SERVING_CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_serving_code_never_unpickles_or_evaluates(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not {a.name.split(".")[0] for a in node.names} & FORBIDDEN_MODULES, ast.dump(node)
        elif isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] not in FORBIDDEN_MODULES, ast.dump(node)
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                assert node.func.id not in FORBIDDEN_BUILTINS, f"{path.name}:{node.lineno} calls {node.func.id}"
            elif isinstance(node.func, ast.Attribute) and node.func.attr in {"load", *FORBIDDEN_METHODS}:
                owner = ast.unparse(node.func.value)  # np.load, yaml.load, pickle.loads...: only JSON parsers may
                assert owner in SAFE_LOADERS, f"{path.name}:{node.lineno} calls {owner}.{node.func.attr}"
            for kw in node.keywords:
                assert not (kw.arg == "allow_pickle" and ast.unparse(kw.value) != "False"), f"{path.name}:{node.lineno}"
