"""Shared fixtures: small random models for most tests, one real MiniLM export per session."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from mhaserve.model.config import TINY, EncoderConfig


@pytest.fixture
def tiny_cfg() -> EncoderConfig:
    return EncoderConfig(**TINY)  # type: ignore[arg-type]


@pytest.fixture
def root_logging() -> Iterator[None]:
    """For a test that configures logging (configure_logging, `main`): the root logger's handlers and level
    as they were, put back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def tiny_entry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny model exported (with its fused, fp16 and int8 variants) into a session repository."""
    from mhaserve.export.publish import ExportOptions, export_entry

    repo = tmp_path_factory.mktemp("repo")
    opts = ExportOptions(
        source="random",
        repository=repo,
        name="tiny",
        random_config=dict(TINY),
        seed=7,
        optimize=True,
        fp16=True,
        int8=True,
    )
    return export_entry(opts, out=io.StringIO())


@pytest.fixture(scope="session")
def tiny_repo(tiny_entry: Path) -> Path:
    """The repository holding the tiny model (its only model, `tiny`, version 1)."""
    return tiny_entry.parent.parent


@pytest.fixture(scope="session")
def minilm_entry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2 exported once per session, as `make serve` does (fp32 and fused graphs), and its int8 graph."""
    from mhaserve.export.publish import ExportOptions, export_entry

    repo = tmp_path_factory.mktemp("models")
    return export_entry(ExportOptions(repository=repo, optimize=True, int8=True), out=io.StringIO())


@pytest.fixture(scope="module", params=["grpc", "lean"])
def grpc_front(request: pytest.FixtureRequest) -> str:
    """Each `--grpc-front`: the tests of a fixture that asks for it run on both (docs/grpc-fronts.md)."""
    return str(request.param)


@pytest.fixture(scope="session")
def sentence_transformer():
    """The reference implementation, loaded offline from the same checkpoint directory."""
    from sentence_transformers import SentenceTransformer

    from mhaserve.model.checkpoint import default_source

    return SentenceTransformer(str(default_source()), device="cpu")


# Inputs that exercise the tokenizer and the model: scripts, emoji, empty, and past 256 tokens.
VARIED_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Une phrase en français, avec des accents: éàç.",
    "Пример текста на русском языке.",
    "これは日本語の文です。",
    "مرحبا بالعالم",
    "emoji 🤖🚀 and symbols ∑∞ ≠ ≤",
    "",
    "   ",
    "a",
    "Transformers " * 300,  # ~600 tokens: must be truncated to 256
]


@pytest.fixture
def gpu_without_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A host that shows a GPU where ONNX Runtime cannot load CUDA: this one, told a GPU is there (onnxruntime-gpu
    lists CUDAExecutionProvider here, and its libraries do not load)."""
    from mhaserve.runtime import devices

    monkeypatch.setattr(devices, "cuda_device_visible", lambda: True)
    devices.cuda_loads.cache_clear()
    yield
    devices.cuda_loads.cache_clear()
