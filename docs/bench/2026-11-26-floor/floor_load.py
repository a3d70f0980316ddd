"""floor.py under load: 32 clients at once for SECONDS, against each server of floor.py; calls a second
and the server's CPU per call.

The clients are the bench's (grpc.aio on one channel; one keep-alive HTTP/1.1 connection each), in this
process. The empty servers answer at once, so their rate is what the two cores give client and server
together; ours sleep 5 ms a batch in the scripted engine. The CPU per call is what each server spends
around a request when many arrive at once, which on a real model is taken from ONNX Runtime's cores.
Run from the repository root: python docs/bench/2026-11-26-floor/floor_load.py ROUNDS SECONDS [KIND ...]
"""

import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc.aio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: one_client.py
import floor
from one_client import SHORT_TEXTS, raw

from mhaserve.loadtest.bench.quiet import process_cpu_seconds
from mhaserve.loadtest.bench.transports import HttpConnection
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.service.client import CHANNEL_OPTIONS

CLIENTS = 32
KINDS = ["grpc-empty", "grpc-ours", "http-empty", "http-ours"]


async def load(kind: str, port: int, grpc_port: int, seconds: float) -> int:
    """Calls answered by CLIENTS clients in a closed loop for `seconds`."""
    stop = time.perf_counter() + seconds
    done = 0

    async def grpc_loop(call, i: int) -> None:  # type: ignore[no-untyped-def]
        nonlocal done
        while time.perf_counter() < stop:
            await call(SHORT_TEXTS[i % len(SHORT_TEXTS)])
            done += 1
            i += CLIENTS

    async def http_loop(i: int) -> None:
        nonlocal done
        conn = HttpConnection("127.0.0.1", port)
        while time.perf_counter() < stop:
            status, _ = await conn.request(raw(SHORT_TEXTS[i % len(SHORT_TEXTS)], port))
            assert status == 200, status
            done += 1
            i += CLIENTS
        conn.close()

    if kind.startswith("http"):
        await asyncio.gather(*(http_loop(i) for i in range(CLIENTS)))
        return done
    ours = kind.endswith("-ours")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port if ours else port}", options=CHANNEL_OPTIONS) as ch:
        if ours:
            stub = pbg.EncoderServiceStub(ch)

            def call(text: str):  # type: ignore[no-untyped-def]
                return stub.Encode(pb.EncodeRequest(texts=[text], truncate=True))
        else:
            method = ch.unary_unary(
                "/floor.Empty/Call", request_serializer=floor.same, response_deserializer=floor.same
            )

            def call(text: str):  # type: ignore[no-untyped-def]
                return method(text.encode())

        await asyncio.gather(*(grpc_loop(call, i) for i in range(CLIENTS)))
    return done


def measure(kind: str, seconds: float) -> tuple[float, float]:
    """(calls a second, the server's CPU per call in us)."""
    port, grpc_port = floor.free_port(), floor.free_port()
    server = floor.start(kind, port, grpc_port, Path(f"/tmp/floor-load-{kind}.log"))
    try:
        asyncio.run(load(kind, port, grpc_port, 1.0))  # warm up
        cpu0, t0 = process_cpu_seconds(server.pid), time.perf_counter()
        calls = asyncio.run(load(kind, port, grpc_port, seconds))
        elapsed, cpu = time.perf_counter() - t0, process_cpu_seconds(server.pid) - cpu0
    finally:
        server.send_signal(2)
        server.wait()
    return calls / elapsed, cpu / calls * 1e6


def main() -> None:
    kinds = sys.argv[3:] or KINDS
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for r in range(int(sys.argv[1])):
        for kind in kinds if r % 2 == 0 else list(reversed(kinds)):
            results[kind].append(measure(kind, float(sys.argv[2])))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1][0]:.0f}/s ({v[-1][1]:.0f} us CPU)" for k, v in results.items()),
              flush=True)  # fmt: skip
    print(f"medians of the rounds, {CLIENTS} clients (calls a second; the server's CPU per call):")
    for kind, rows in results.items():
        rate, cpu = (statistics.median(column) for column in zip(*rows, strict=True))
        print(f"  {kind:11s} {rate:7.0f}/s  {cpu:6.0f} us")


if __name__ == "__main__":
    main()
