"""Where a lone gRPC request's time goes in today's server, stage by stage (the 2026-11-25 trace redone for the
code since: the hand-back through `_finish`, the batcher's turns of 2026-11-26/27).

`python stages_grpc.py` (from the repository root) starts itself as the server (`serve`, below: `mhaserve
serve` on models/ with a timestamp at each stage, written to a file at exit), sends 200 short texts to warm
up and then N one at a time from grpcio's synchronous stub, stops the server and prints the median of each
stage. The stamps wrap functions in one more Python frame each, so read the shares, not the sum.
Run: python docs/bench/2026-11-27-fourteenth/stages_grpc.py [N]
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

events: list[tuple[str, int]] = []
now = time.perf_counter_ns
TRACE = Path("/tmp/stages-grpc.tsv")


def stamp(owner: Any, name: str, label: str, done: str | None = None) -> None:
    """Record `label` when owner.name is called and, with `done`, that label when it returns (a coroutine
    function: when its coroutine finishes)."""
    fn = getattr(owner, name)
    if asyncio.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            events.append((label, now()))
            out = await fn(*args, **kwargs)
            if done:
                events.append((done, now()))
            return out
    else:

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            events.append((label, now()))
            out = fn(*args, **kwargs)
            if done:
                events.append((done, now()))
            return out

    setattr(owner, name, wrapper)


def serve(argv: list[str]) -> int:
    from mhaserve.cli.main import main
    from mhaserve.runtime.engine import OnnxEngine
    from mhaserve.service import dataplane, encoder_v1, pipeline
    from mhaserve.service.batching import batcher, watchdog
    from mhaserve.service.rpc import interceptors

    class StampedLoop:
        """The loop as the inference thread sees it: its hand-back stamped."""

        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop = loop

        def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any) -> Any:
            events.append(("G2 thread hands back", now()))
            return self.loop.call_soon_threadsafe(callback, *args)

    infer = batcher.Batcher._infer

    def stamped_infer(self: Any, batch: Any, loop: Any, run: Any, begun: Any) -> None:
        events.append(("F inference thread runs", now()))
        infer(self, batch, StampedLoop(loop), run, begun)

    stamp(interceptors._Call, "begin", "A interceptor begins")
    stamp(dataplane.DataPlane, "encode", "B data plane")
    stamp(pipeline.Pipeline, "tokenize", "C tokenize", "C2 tokenized")
    stamp(batcher.Batcher, "submit", "D queue")
    stamp(batcher.Batcher, "_execute", "E batcher takes it")
    stamp(watchdog.Watchdog, "guard", "E2 to the thread")
    batcher.Batcher._infer = stamped_infer  # type: ignore[method-assign]
    stamp(OnnxEngine, "run", "F2 engine", "G engine done")
    stamp(batcher.Batcher, "_finish", "G3 loop runs _finish")
    stamp(pipeline.Pipeline, "encode_post", "I normalise")
    stamp(encoder_v1, "to_pb", "J protobuf", "J2 protobuf built")
    stamp(interceptors._Call, "end", "K interceptor ends")
    atexit.register(lambda: TRACE.write_text("".join(f"{n}\t{t}\n" for n, t in events)))
    return main(["serve", *argv])


def drive(n: int) -> None:
    import grpc

    from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
    from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
    from mhaserve.testing.loopback import free_ports

    texts = [t for t in Path("loadtest/texts/short.txt").read_text().splitlines() if t.strip()]
    port, metrics, http = free_ports(3)
    log = Path("/tmp/stages-grpc-serve.log")
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, __file__, "serve", "--repository", "models", "--graph", "optimized", "--port",
             str(port), "--metrics-port", str(metrics), "--http-port", str(http)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.time() + 120
        while "inference worker" not in log.read_text():
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(log.read_text())
            time.sleep(0.2)
        stub = pbg.EncoderServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        latencies = []
        for i in range(200 + n):
            t0 = time.perf_counter()
            stub.Encode(pb.EncodeRequest(texts=[texts[i % len(texts)]], truncate=True), timeout=30)
            latencies.append(time.perf_counter() - t0)
    finally:
        server.send_signal(2)
        server.wait(60)
    requests: list[list[tuple[str, int]]] = []
    for line in TRACE.read_text().splitlines():
        name, t = line.split("\t")
        if name.startswith("A "):
            requests.append([])
        if requests:
            requests[-1].append((name, int(t)))
    requests = requests[-n:]
    order = [name for name, _ in requests[-1]]
    stages: dict[str, list[float]] = {}
    kept = [r for r in requests if [name for name, _ in r] == order]
    for r in kept:
        for (a, t0), (b, t1) in zip(r, r[1:], strict=False):
            stages.setdefault(f"{a} -> {b}", []).append((t1 - t0) / 1000)
        stages.setdefault("whole: interceptor begins -> ends", []).append((r[-1][1] - r[0][1]) / 1000)
    print(f"{len(kept)} of {len(requests)} requests in this order; client p50 "
          f"{1000 * statistics.median(latencies[200:]):.3f} ms")  # fmt: skip
    for stage, values in stages.items():
        print(f"  {stage:<58} {statistics.median(values):8.1f} us")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        sys.exit(serve(sys.argv[2:]))
    drive(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
