"""An empty server: the server's two protocol stacks with nothing behind them.

The gRPC front the server under test runs (the lean front by default, or grpc.aio's with `--grpc-front grpc`;
no interceptors) answers encoder.v1 `Encode`, and our HTTP server (uvicorn with httptools, as `mhaserve
serve` runs it) answers `POST /v1/embeddings`, both on one event loop, with a fixed answer of one embedding:
no validation, tokenising, batching, model or metrics. Each call waits `delay` seconds before its answer,
idle on the loop: the server's loop idles while the model computes a lone text, and on a VM a loop that has
idled a few milliseconds wakes slower and runs colder than one answering back to back (an empty grpc.aio
server took 0.6 ms a call back to back and 1.4-1.95 ms with 5 ms idle between calls, docs/benchmarks.md).
One client's p50 against it, less the delay, is what the protocol stack, the loopback and the client cost a
lone call on this machine; the paired one-client rounds measure it beside the server, with ONNX Runtime's
one-text p50 in whole milliseconds as the delay (the loop waits in epoll, which counts whole milliseconds and
rounds a fraction up), so that the server's gap to ONNX Runtime in process (issue 18: within 1.5 ms) splits
into that floor and what the server adds above it. The floor is the served front's: an empty grpc.aio
server under a lean-front server would count grpc core's cost a lone call (0.42 ms against the lean front's
0.18 on the Zen 5 draw, docs/grpc-fronts.md) as floor, and hide part of what our server adds above it.

Run as `python -m mhaserve.loadtest.bench.empty GRPC_PORT HTTP_PORT DIMENSIONS DELAY_S FRONT` (EmptyServer
does).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import grpc
import grpc.aio
import orjson

from mhaserve.loadtest.bench.client import BenchError, terminate
from mhaserve.loadtest.bench.options import FRONTS
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.service.http.server import HttpServer
from mhaserve.service.rpc.lean.server import LeanServer
from mhaserve.testing.loopback import free_ports
from mhaserve.testing.metrics import Samples

SERVICE = "encoder.v1.EncoderService"
READY = "empty server ready"


def answers(dimensions: int) -> tuple[bytes, bytes]:
    """The fixed answers: an EncodeResponse and an OpenAI embeddings body, each one unit vector."""
    vector = [1 / math.sqrt(dimensions)] * dimensions
    grpc_answer = pb.EncodeResponse(
        embeddings=[pb.Embedding(values=vector)], model="empty", usage=pb.Usage(input_tokens=0)
    ).SerializeToString()
    http_answer = orjson.dumps(
        {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": vector}],
            "model": "empty",
            "usage": {"prompt_tokens": 0, "total_tokens": 0},
        }
    )
    return grpc_answer, http_answer


async def serve(grpc_port: int, http_port: int, dimensions: int, delay: float, front: str) -> None:
    grpc_answer, http_answer = answers(dimensions)

    async def encode(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        await asyncio.sleep(delay)
        return grpc_answer

    head = [(b"content-type", b"application/json"), (b"content-length", str(len(http_answer)).encode())]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body", False):
            pass
        await asyncio.sleep(delay)
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": http_answer})

    server = LeanServer() if front == "lean" else grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(encode)  # no (de)serializers: bytes in, bytes out
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Encode": handler}),))
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await server.start()
    http = HttpServer(app, host="127.0.0.1", port=http_port, read_timeout=30.0)
    http.bind()
    await http.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(READY, flush=True)
    await stop.wait()
    await http.stop(1.0)
    await server.stop(1.0)


class EmptyServer:
    """The empty server in a process of its own on free ports, its gRPC port served by `front` (lean or grpc,
    as `mhaserve serve --grpc-front`), each call answered `delay` seconds after it arrives; measured by
    `run_point` as a server is: its addresses, its process's CPU; it has no metrics (no batches to count)."""

    own_channels = False
    grpc_client = "aio"  # the bench's run sets its --grpc-client

    def __init__(self, dimensions: int, delay: float, log_path: Path, front: str = "lean") -> None:
        if front not in FRONTS:
            raise ValueError(f"no gRPC front {front!r}: one of {', '.join(FRONTS)}")
        self.dimensions = dimensions
        self.delay = delay
        self.front = front
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.address = self.http_url = ""

    def start(self, timeout: float = 60.0) -> None:
        port, http_port = free_ports(2)
        self.address, self.http_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
        self._log = self.log_path.open("wb")
        argv = [
            sys.executable,
            "-m",
            "mhaserve.loadtest.bench.empty",
            str(port),
            str(http_port),
            str(self.dimensions),
            str(self.delay),
            self.front,
        ]
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while READY not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
                raise BenchError(f"the empty server did not start: {self.log_path} ends\n{tail}")
            time.sleep(0.05)

    def pids(self) -> list[int]:
        assert self.proc is not None
        return [self.proc.pid]

    def scrape(self) -> Samples:
        raise OSError("the empty server has no metrics")

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, timeout=10)
        if self._log is not None:
            self._log.close()

    @contextlib.contextmanager
    def running(self) -> Iterator[EmptyServer]:
        self.start()
        try:
            yield self
        finally:
            self.stop()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]))
