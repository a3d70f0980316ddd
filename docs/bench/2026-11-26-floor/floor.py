"""The floor under one client's round trip on this machine: what an empty server costs, beside ours.

Issue 18 asks a lone request's p50 to be within 1.5 ms of ONNX Runtime in process one text at a time. A
served request also pays the transport and the client, which the in-process run does not. This script
measures that floor with the same clients as the bench: each round starts, one after another,
- `tcp`: an asyncio TCP server that answers every read with 1,600 bytes (a raw socket client);
- `grpc-empty`: grpc.aio (as our server), one unary method over raw bytes, no interceptors, answering
  1,600 bytes at once (384 float32 are 1,536 bytes in protobuf), called from a synchronous stub;
- `http-empty`: uvicorn with httptools (as our server) and a bare ASGI app that reads the body and answers
  a 384-float JSON body at once, called with raw HTTP/1.1 on one keep-alive connection;
- `grpc-empty-intercepted` (not in the default set): `grpc-empty` behind two interceptors shaped like ours
  (each awaits the continuation; the first rewraps the handler in a coroutine of its own, per call, as
  the call bookkeeping does; the second returns the handler as the drain does for unary methods);
- `grpc-sync-empty` (not in the default set): the same method on grpcio's synchronous server, and
  `grpclib-empty` on grpclib (see grpclib_empty.py);
- `grpc-ours` and `http-ours`: our server (`python -m mhaserve.testing.fake_server`, defaults) with the
  scripted engine of the tests, 5 ms asleep a batch and no model, called with `Encode` and the OpenAI route
  by the same clients.
Each empty server answers at once, so its client waits 5 ms between calls: every server then idles 5 ms
before it answers, as ours does while the engine sleeps (on this VM a thread that has idled wakes slower).
Our p50s are given less the engine's 5 ms. Per configuration: 200 calls to warm up, then 1,000, one at a
time; the p50, and the server process's CPU time per call (utime + stime from /proc, over the 1,000).
Run from the repository root: python docs/bench/2026-11-26-floor/floor.py ROUNDS [KIND ...]
(`grpclib-empty`, the empty server on grpclib, needs $GRPCLIB_PYTHON: see grpclib_empty.py.)
"""

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: one_client.py
from one_client import SHORT_TEXTS, http_latencies, latencies

from mhaserve.loadtest.bench.quiet import process_cpu_seconds
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.testing.loopback import free_port

ANSWER = b"x" * 1600
JSON_ANSWER = (b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":['
               + b",".join([b"-0.0123456789"] * 384) + b"]}]}")  # fmt: skip
GAP = 0.005
KINDS = ["tcp", "grpc-empty", "grpc-ours", "http-empty", "http-ours"]
ENGINE = 0.005


def same(data: bytes) -> bytes:
    return data


# --- the empty servers, each run as `floor.py serve KIND PORT` -------------------------------------------


async def tcp_server(port: int) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            writer.write(ANSWER)

    server = await asyncio.start_server(answer, "127.0.0.1", port)
    await server.serve_forever()


class Rewrapping(grpc.aio.ServerInterceptor):
    """Awaits the continuation, then wraps the handler's behaviour in a coroutine of its own, per call."""

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        handler = await continuation(details)

        async def wrapper(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await handler.unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(wrapper, handler.request_deserializer, handler.response_serializer)


class Passing(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        return await continuation(details)


async def grpc_server(port: int, intercepted: bool = False) -> None:
    async def method(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return ANSWER

    server = grpc.aio.server(interceptors=[Rewrapping(), Passing()] if intercepted else None)
    handler = grpc.unary_unary_rpc_method_handler(method, same, same)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Empty", {"Call": handler}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def asgi_app(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(JSON_ANSWER)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": JSON_ANSWER})


def grpc_sync_server(port: int) -> None:
    """The same method on grpcio's synchronous server: each call runs on a thread of its pool."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: ANSWER, same, same)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Empty", {"Call": handler}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def serve(kind: str, port: int) -> None:
    if kind == "grpc-sync-empty":
        grpc_sync_server(port)
    elif kind == "http-empty":
        import uvicorn

        uvicorn.run(asgi_app, host="127.0.0.1", port=port, http="httptools", log_level="warning", lifespan="off")
    else:
        asyncio.run(tcp_server(port) if kind == "tcp" else grpc_server(port, kind == "grpc-empty-intercepted"))


# --- the clients -----------------------------------------------------------------------------------------


def texts(n: int) -> list[str]:
    return (SHORT_TEXTS * 10)[:n]


def tcp_client(port: int, n: int, gap: float) -> list[float]:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def call(text: str) -> None:
            s.sendall(text.encode())
            got = 0
            while got < len(ANSWER):
                got += len(s.recv(65536))

        return latencies(call, texts(n), gap)


def grpc_client(port: int, n: int, gap: float, ours: bool) -> list[float]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        if ours:
            stub = pbg.EncoderServiceStub(channel)
            return latencies(lambda t: stub.Encode(pb.EncodeRequest(texts=[t], truncate=True)), texts(n), gap)
        method = channel.unary_unary("/floor.Empty/Call", request_serializer=same, response_deserializer=same)
        return latencies(lambda t: method(t.encode()), texts(n), gap)


def http_client(port: int, n: int, gap: float) -> list[float]:
    """The bench's client (one keep-alive connection, raw HTTP/1.1), one call at a time, `gap` s apart."""
    return asyncio.run(http_latencies(port, texts(n), gap))


# --- one round -------------------------------------------------------------------------------------------


def start(kind: str, port: int, grpc_port: int, log: Path) -> subprocess.Popen[bytes]:
    if kind.endswith("-ours"):
        flags = ["--engine", f"slow:{ENGINE}", "--repository", "models", "--metrics-port", "0",
                 "--port", str(grpc_port), "--http-port", str(port)]  # fmt: skip
        cmd = [sys.executable, "-m", "mhaserve.testing.fake_server", *flags]
    elif kind == "grpclib-empty":
        cmd = [os.environ["GRPCLIB_PYTHON"], str(Path(__file__).with_name("grpclib_empty.py")), str(port)]
    else:
        cmd = [sys.executable, __file__, "serve", kind, str(port)]
    with log.open("w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    while True:
        assert server.poll() is None, log.read_text()
        if not kind.endswith("-ours") or "serving all-minilm" in log.read_text():
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                pass
        time.sleep(0.2)
    time.sleep(1)
    return server


def client(kind: str, port: int, grpc_port: int) -> Callable[[int], list[float]]:
    """`run(n)`: n calls, one at a time, from the client for `kind`; their latencies."""
    ours = kind.endswith("-ours")
    gap = 0.0 if ours else GAP
    if kind == "tcp":
        return lambda n: tcp_client(port, n, gap)
    if kind.startswith("grpc"):
        return lambda n: grpc_client(grpc_port if ours else port, n, gap, ours)
    return lambda n: http_client(port, n, gap)


def measure(kind: str) -> tuple[float, float]:
    """(p50 in ms, less the engine's 5 ms for ours; the server's CPU per call in us)."""
    port, grpc_port = free_port(), free_port()
    server = start(kind, port, grpc_port, Path(f"/tmp/floor-{kind}.log"))
    run = client(kind, port, grpc_port)
    try:
        run(200)
        cpu0 = process_cpu_seconds(server.pid)
        taken = run(1000)
        cpu = (process_cpu_seconds(server.pid) - cpu0) / 1000 * 1e6
    finally:
        server.send_signal(2)
        server.wait()
    return 1000 * (statistics.median(taken) - (ENGINE if kind.endswith("-ours") else 0)), cpu


def main() -> None:
    kinds = sys.argv[2:] or KINDS
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for r in range(int(sys.argv[1])):
        for kind in kinds if r % 2 == 0 else list(reversed(kinds)):
            results[kind].append(measure(kind))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1][0]:.2f} ms ({v[-1][1]:.0f} us CPU)" for k, v in results.items()),
              flush=True)  # fmt: skip
    print("medians of the rounds (p50, ms; ours less the engine's 5 ms) and the server's CPU per call (us):")
    for kind, rows in results.items():
        p50, cpu = (statistics.median(column) for column in zip(*rows, strict=True))
        print(f"  {kind:11s} {p50:5.2f} ms  {cpu:6.0f} us")


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        main()
