"""The CUDA path: `mhaserve.testing.gpu_check` on the tiny model where ONNX Runtime loads CUDA, a clear failure else."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from functools import cache
from pathlib import Path

import grpc.aio
import pytest

from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.runtime import devices
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.errors import Unavailable
from mhaserve.runtime.manifest import read_manifest
from mhaserve.service.settings import Settings
from mhaserve.testing import gpu_check
from mhaserve.testing.server import ServerThread


@cache
def _cuda_loads(graph: Path, max_seq_len: int, vocab_size: int) -> bool:
    try:
        OnnxEngine(graph, max_seq_len=max_seq_len, vocab_size=vocab_size, device="cuda")
    except Unavailable:
        return False
    return True


def cuda_loads(entry: Path) -> bool:
    m = read_manifest(entry)
    return _cuda_loads(entry / "model.onnx", m.max_seq_len, m.vocab_size)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", ["fp32", "optimized", "fp16"])
def test_gpu_check_passes_on_cuda(tiny_entry: Path, graph: str, capsys: pytest.CaptureFixture[str]) -> None:
    if not cuda_loads(tiny_entry):
        pytest.skip("ONNX Runtime cannot load CUDA on this host")
    argv = ["--repository", str(tiny_entry.parent.parent), "--model", "tiny", "--graph", graph, "--seconds", "1"]
    assert gpu_check.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "CUDAExecutionProvider" in out and "gpu-check: passed" in out


@pytest.mark.gpu
def test_device_auto_finds_cuda_where_it_loads(tiny_entry: Path) -> None:
    """The probe behind `--device auto` (devices.cuda_loads) says yes where a session gets CUDA."""
    if not cuda_loads(tiny_entry):
        pytest.skip("ONNX Runtime cannot load CUDA on this host")
    assert devices.cuda_loads() and devices.wants_cuda("auto")


def test_gpu_check_fails_clearly_without_cuda(tiny_entry: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if cuda_loads(tiny_entry):
        pytest.skip("CUDA loads here: test_gpu_check_passes_on_cuda covers this host")
    assert gpu_check.main(["--repository", str(tiny_entry.parent.parent), "--model", "tiny", "--seconds", "1"]) == 1
    err = capsys.readouterr().err
    assert "gpu-check: FAILED: --device cuda was asked for but ONNX Runtime could not load CUDA" in err


def test_the_throughput_run_asks_for_truncation(settings: Settings, start: Callable[..., ServerThread]) -> None:
    """The run's longest texts are more than the tiny model's 160 tokens: without truncate the server refuses them
    (the first GPU host found this: the check failed with INVALID_ARGUMENT after parity passed). Runs on the CPU."""
    srv = start(dataclasses.replace(settings, auto_truncate=False))

    async def run() -> str:
        async with grpc.aio.insecure_channel(srv.address) as channel:
            return await gpu_check.server_throughput(pb_grpc.EncoderServiceStub(channel), 0.3, 2)

    assert "inputs/s" in asyncio.run(run())
