"""The server with a timestamp at each stage of an HTTP request's path (the code of this folder's commit),
written to $TRACE_OUT at exit. Started by stages.py. With `--engine SPEC` first, the scripted-engine server
of the tests; otherwise `mhaserve serve` with the model. Every other argument is the server's own."""

import asyncio
import atexit
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http import httptools_impl as h

from mhaserve.cli.main import main as serve_main
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.service import openai, pipeline
from mhaserve.service.batching import batcher, watchdog
from mhaserve.service.http import middleware
from mhaserve.testing import engines
from mhaserve.testing.fake_server import main as scripted_main

events: list[tuple[str, int]] = []
now = time.perf_counter_ns


def stamp(owner: Any, name: str, label: str) -> None:
    """Record `label` each time owner.name is called (a coroutine function: when it is called, not awaited)."""
    fn = getattr(owner, name)
    if asyncio.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            events.append((label, now()))
            return await fn(*args, **kwargs)
    else:

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            events.append((label, now()))
            return fn(*args, **kwargs)

    setattr(owner, name, wrapper)


def after(owner: Any, name: str, label: str) -> None:
    """Record `label` when owner.name (a plain function) returns."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        events.append((label, now()))
        return out

    setattr(owner, name, wrapper)


class StampedLoop:
    """The loop as the inference thread sees it: its hand-back stamped."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any) -> Any:
        events.append(("G2 thread hands back", now()))
        return self.loop.call_soon_threadsafe(callback, *args)


infer = batcher.Batcher._infer


def stamped_infer(self: Any, batch: Any, loop: Any, run: Any) -> None:
    events.append(("F infer (thread)", now()))
    infer(self, batch, StampedLoop(loop), run)


sent = h.RequestResponseCycle.send


async def send(self: Any, message: Any) -> None:
    events.append(("J send head" if message["type"] == "http.response.start" else "J2 send body", now()))
    await sent(self, message)


def dump() -> None:
    with open(os.environ["TRACE_OUT"], "w") as f:
        f.writelines(f"{n}\t{t}\n" for n, t in events)


stamp(h.HttpToolsProtocol, "data_received", "A bytes in")
stamp(h.RequestResponseCycle, "run_asgi", "A2 uvicorn runs the app")
stamp(middleware.CallMiddleware, "_refusal", "A3 middleware: auth, gate")
stamp(middleware.CallMiddleware, "_body", "A4 middleware: body")
stamp(middleware.CallMiddleware, "_run", "A5 middleware: run")
stamp(middleware.CallMiddleware, "_fast", "B fast route")
stamp(openai, "parse_json", "C parse, validate")
stamp(pipeline.Pipeline, "tokenize", "C2 tokenize")
stamp(batcher.Batcher, "submit", "D queue")
stamp(batcher.Batcher, "_execute", "E batcher takes it")
stamp(watchdog.Watchdog, "guard", "E2 to the thread")
batcher.Batcher._infer = stamped_infer  # type: ignore[method-assign]
stamp(batcher, "_settle", "G3 loop settles the future")
stamp(batcher.Batcher, "_resolve", "H resolve the requests")
stamp(pipeline.Pipeline, "encode_post", "I normalise")
stamp(openai, "to_response", "I2 JSON")
h.RequestResponseCycle.send = send  # type: ignore[method-assign]
atexit.register(dump)
if sys.argv[1:2] == ["--engine"]:
    stamp(engines.ScriptedEngine, "run", "F2 engine")
    engines.time = type(sys)("scripted_time")  # the engine's own `time.sleep`, stamped
    engines.time.sleep = lambda s: (time.sleep(s), events.append(("G engine done", now())))  # type: ignore[attr-defined]
    engines.time.perf_counter = time.perf_counter  # type: ignore[attr-defined]
    sys.exit(scripted_main(sys.argv[1:]))
stamp(OnnxEngine, "run", "F2 engine")
after(OnnxEngine, "run", "G engine done")
sys.exit(serve_main(["serve", *sys.argv[1:]]))
