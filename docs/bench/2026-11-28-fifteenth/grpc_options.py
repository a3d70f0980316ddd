"""Does a gRPC core option, or a connection per client, cut grpc.aio's own CPU a call?

An empty grpc.aio server (one unary method over raw bytes, no interceptors, answering 1,600 bytes: about 384
float32 in protobuf) is started afresh for each configuration, in alternated rounds; 32 grpc.aio clients call
it for 4 s (the server's CPU a call, from /proc, and calls a second), then one client for 2 s (its p50).
With MANY=1 every client has a channel (a connection) of its own; by default they share one, as the bench's.
Run from the repository root: python docs/bench/2026-11-28-fifteenth/grpc_options.py ROUNDS [CONFIG ...]
"""

import asyncio
import os
import statistics
import subprocess
import sys
import time

import grpc

from mhaserve.loadtest.bench.quiet import process_cpu_seconds
from mhaserve.testing.loopback import free_port

ANSWER = b"x" * 1600
OPTIONS: dict[str, list[tuple[str, int | str]]] = {
    "base": [],
    "bdp0": [("grpc.http2.bdp_probe", 0)],
    "lat": [("grpc.optimization_target", "latency")],
    "thr": [("grpc.optimization_target", "throughput")],
    "nocensus": [("grpc.census", 0), ("grpc.enable_channelz", 0)],
}
MANY = bool(os.environ.get("MANY"))


def serve(config: str, port: int) -> None:
    async def main() -> None:
        async def same(_request: bytes, _context: object) -> bytes:
            return ANSWER

        handler = grpc.method_handlers_generic_handler("x.X", {"Do": grpc.unary_unary_rpc_method_handler(same)})
        server = grpc.aio.server(options=OPTIONS[config])
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def load(port: int, clients: int, seconds: float) -> tuple[int, float, float]:
    """(calls, seconds, p50 seconds) of `clients` closed-loop clients."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(clients if MANY else 1)]
    calls = [channel.unary_unary("/x.X/Do") for channel in channels]
    for _ in range(200):
        await calls[0](b"y" * 200)
    stop = time.perf_counter() + seconds
    latencies: list[float] = []

    async def user(i: int) -> int:
        n, call = 0, calls[i % len(calls)]
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            await call(b"y" * 200)
            latencies.append(time.perf_counter() - t0)
            n += 1
        return n

    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*(user(i) for i in range(clients))))
    elapsed = time.perf_counter() - t0
    for channel in channels:
        await channel.close()
    return n, elapsed, statistics.median(latencies)


def main(rounds: int, configs: list[str]) -> None:
    results: dict[str, list[tuple[float, float, float]]] = {c: [] for c in configs}
    for r in range(rounds):
        for config in configs if r % 2 == 0 else configs[::-1]:
            port = free_port()
            server = subprocess.Popen([sys.executable, __file__, "serve", config, str(port)])
            time.sleep(1.5)
            asyncio.run(load(port, 32, 1))
            c0 = process_cpu_seconds(server.pid) or 0.0
            n, elapsed, _ = asyncio.run(load(port, 32, 4))
            cpu_us = ((process_cpu_seconds(server.pid) or 0.0) - c0) / n * 1e6
            _, _, p50 = asyncio.run(load(port, 1, 2))
            server.kill()
            server.wait()
            results[config].append((cpu_us, n / elapsed, p50 * 1e3))
            print(f"round {r} {config:9s} 32 clients: {n / elapsed:7.0f} calls/s, server CPU {cpu_us:4.0f} us a call; "
                  f"1 client p50 {p50 * 1e3:.3f} ms", flush=True)  # fmt: skip
    for config, rows in results.items():
        cpu, rate, p50 = (statistics.median(row[i] for row in rows) for i in range(3))
        print(f"{config:9s} medians: server CPU {cpu:.0f} us a call, {rate:.0f} calls/s, 1 client p50 {p50:.3f} ms")


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        main(int(sys.argv[1]), sys.argv[2:] or list(OPTIONS))
