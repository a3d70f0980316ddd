"""Where a model runs: the --device choices, whether this host shows a GPU, and whether ONNX Runtime loads CUDA
on it. engine.py asks this module which providers a session gets; settings and the repository ask it what a
device means for workers and graphs."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

DEVICES = ("auto", "cuda", "cpu")
Device = Literal["auto", "cuda", "cpu"]
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


@functools.cache
def cuda_device_visible() -> bool:
    """Whether this host shows a CUDA device: a /dev/nvidia<N> node, or a driver that counts one (WSL).

    onnxruntime-gpu lists CUDAExecutionProvider whether or not a GPU or the CUDA libraries are there,
    and logs a red error when it then fails to load them; `--device auto` asks this first, so a
    CPU-only host starts quietly.
    """
    if any(Path("/dev").glob("nvidia[0-9]*")):
        return True
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        return bool(cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0)
    except (OSError, AttributeError):
        return False


def wants_cuda(device: str) -> bool:
    """Whether an engine for `device` asks ONNX Runtime for CUDA: `cuda`, or `auto` on a host that shows a GPU
    to an ONNX Runtime built with CUDA and where CUDA loads (cuda_loads). With `cuda` a session may still fall
    back to the CPU when CUDA's libraries do not load: OnnxEngine checks the providers its session got."""
    if device != "auto":
        return device == "cuda"
    if not cuda_device_visible():  # first: a CPU host answers without importing ONNX Runtime
        return False
    import onnxruntime as ort

    return CUDA in ort.get_available_providers() and cuda_loads()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    """One protobuf field: a varint, or length-delimited bytes."""
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _identity_model() -> bytes:
    """The smallest ONNX model, y = Identity(x) over a float vector, serialized by hand: serving does not install
    the onnx package. Field numbers are onnx.proto's (ModelProto: ir_version 1, graph 7, opset_import 8; GraphProto:
    node 1, name 2, input 11, output 12; NodeProto: input 1, output 2, op_type 4)."""
    vector = _field(1, _field(1, 1) + _field(2, _field(1, _field(2, b"n"))))  # tensor_type {FLOAT, shape [n]}
    node = _field(1, b"x") + _field(2, b"y") + _field(4, b"Identity")
    graph = (
        _field(1, node)
        + _field(2, b"probe")
        + _field(11, _field(1, b"x") + _field(2, vector))
        + _field(12, _field(1, b"y") + _field(2, vector))
    )
    return _field(1, 8) + _field(7, graph) + _field(8, _field(2, 13))


def preload_cuda() -> None:
    """onnxruntime-gpu[cuda,cudnn] installs CUDA and cuDNN as pip packages that the dynamic loader does not
    search; preloading them lets a plain venv on a GPU host find them (a system CUDA on the default paths still
    works: those are searched after the pip packages)."""
    import onnxruntime as ort

    with contextlib.suppress(Exception):
        ort.preload_dlls()


@functools.cache
def cuda_loads() -> bool:
    """Whether ONNX Runtime gets CUDA for a session on this host, tried once on a one-node graph.

    A host can show a GPU and list CUDAExecutionProvider yet fail to load it (cuDNN missing, CUDA libraries of
    another major version, a driver too old): ONNX Runtime logs why and runs the session on the CPU. Asked by
    `--device auto`, so that such a host is served as a CPU host is (the CPU graph, its inference workers, the
    overlap session and spinning threads), not as a GPU host that happens to compute on the CPU.
    """
    import onnxruntime as ort

    preload_cuda()
    try:
        got = ort.InferenceSession(_identity_model(), providers=[CUDA, CPU]).get_providers()
    except Exception as e:  # noqa: BLE001 (whatever CUDA's failure raises, the answer is no)
        got = [f"none: {e}"]
    if got[0] == CUDA:
        return True
    log.warning(
        "this host shows a GPU but ONNX Runtime could not load CUDA (its error above names what is missing); "
        "--device auto serves on the CPU, as on a host without a GPU (got %s)",
        got,
    )
    return False
