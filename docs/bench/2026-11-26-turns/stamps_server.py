"""The server with four timestamps per HTTP request: its bytes in (A), the engine's start (F), the end of
the engine's work (G), the body's send (J). Written to $TRACE_OUT at exit. Started by trace_ab.py.
Per gRPC `Encode` call, A and J are the servicer's entry and return (grpc.aio and the interceptors are
outside them).

With `--engine SPEC` first, the scripted-engine server of the tests (`python -m mhaserve.testing.fake_server`),
G at the end of its sleep; otherwise `mhaserve serve` with the model, G when ONNX Runtime's run returns.
Every other argument is the server's own."""

import atexit
import os
import sys
import time

from uvicorn.protocols.http import httptools_impl as h

from mhaserve.cli.main import main as serve_main
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.service.encoder_v1 import EncoderServicer
from mhaserve.testing import engines
from mhaserve.testing.fake_server import main as scripted_main

events: list[tuple[str, int]] = []
now = time.perf_counter_ns

received = h.HttpToolsProtocol.data_received


def data_received(self, data):  # type: ignore[no-untyped-def]
    events.append(("A", now()))
    return received(self, data)


engine_run = engines.ScriptedEngine.run


def run(self, *args):  # type: ignore[no-untyped-def]
    events.append(("F", now()))
    return engine_run(self, *args)


onnx_run = OnnxEngine.run


def model_run(self, *args):  # type: ignore[no-untyped-def]
    events.append(("F", now()))
    out = onnx_run(self, *args)
    events.append(("G", now()))
    return out


def sleep(seconds: float) -> None:
    time.sleep(seconds)
    events.append(("G", now()))


sent = h.RequestResponseCycle.send


async def send(self, message):  # type: ignore[no-untyped-def]
    if message["type"] == "http.response.body":
        events.append(("J", now()))
    await sent(self, message)


encode = EncoderServicer.Encode


async def stamped_encode(self, request, context):  # type: ignore[no-untyped-def]
    events.append(("A", now()))
    try:
        return await encode(self, request, context)
    finally:
        events.append(("J", now()))


def dump() -> None:
    with open(os.environ["TRACE_OUT"], "w") as f:
        f.writelines(f"{n}\t{t}\n" for n, t in events)


h.HttpToolsProtocol.data_received = data_received
h.RequestResponseCycle.send = send
EncoderServicer.Encode = stamped_encode  # type: ignore[method-assign]
atexit.register(dump)
if sys.argv[1:2] == ["--engine"]:
    engines.ScriptedEngine.run = run
    engines.time = type(sys)("scripted_time")  # the engine's own `time.sleep`, stamped; nothing else changes
    engines.time.sleep = sleep
    engines.time.perf_counter = time.perf_counter
    sys.exit(scripted_main(sys.argv[1:]))
OnnxEngine.run = model_run
sys.exit(serve_main(["serve", *sys.argv[1:]]))
