"""A/B of the code itself: the server's service/ files at two commits, alternated in rounds on one machine.

Each round checks out each version's service/ (the editable install serves them), starts the server
(defaults, the fused graph), and measures one client's p50 over the first 300 short texts, over gRPC (a
synchronous stub) and over HTTP (one keep-alive connection, the OpenAI route); then 32 closed-loop clients
for SECONDS each over gRPC (grpc.aio, one channel) and over HTTP (raw HTTP/1.1, a connection each). Once per
round, ONNX Runtime in this process on the same 300 texts one at a time (the fused graph, tokeniser
counted): the reference of the one-client target. The working tree's service/ is restored at the end.
Run from the repository root: python ab_turns.py BEFORE AFTER ROUNDS SECONDS
With AB_ENGINE=slow:0.005 the server runs the scripted engine of the tests (5 ms asleep a batch, no model):
what is left over 5 ms is the server's own time around the model, without the model's noise.
"""

import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: one_client.py
from one_client import SHORT_TEXTS, in_process, p50_ms, raw, served_p50s

from mhaserve.loadtest.bench.transports import HttpConnection
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.testing.loopback import free_port
from mhaserve.testing.process import ServerProcess

TEXTS = SHORT_TEXTS
LONE = TEXTS[:300]
ENGINE = os.environ.get("AB_ENGINE")  # a scripted engine's spec (testing/engines.py), or the model


async def closed_loop(send, n_clients: int, seconds: float) -> float:
    stop = time.perf_counter() + seconds

    async def user(i: int) -> int:
        n, k = 0, i
        while time.perf_counter() < stop:
            await send(i, k % len(TEXTS))
            n, k = n + 1, k + n_clients
        return n

    t0 = time.perf_counter()
    done = sum(await asyncio.gather(*(user(i) for i in range(n_clients))))
    return done / (time.perf_counter() - t0)


async def grpc_32(address: str, seconds: float) -> float:
    requests = [pb.EncodeRequest(texts=[t], truncate=True) for t in TEXTS]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pbg.EncoderServiceStub(channel)

        async def send(_: int, k: int) -> None:
            await stub.Encode(requests[k], timeout=60)

        await closed_loop(send, 32, 1.0)  # warm-up
        return await closed_loop(send, 32, seconds)


async def http_32(port: int, seconds: float) -> float:
    requests = [raw(t, port) for t in TEXTS]
    conns = [HttpConnection("127.0.0.1", port) for _ in range(32)]

    async def send(i: int, k: int) -> None:
        status, _ = await conns[i].request(requests[k])
        assert status == 200

    await closed_loop(send, 32, 1.0)
    rate = await closed_loop(send, 32, seconds)
    for c in conns:
        c.close()
    return rate


def measure(address: str, port: int, seconds: float) -> dict[str, float]:
    """One client's p50 over gRPC and HTTP, then 32 clients' calls a second over each, against one server."""
    grpc_p50, http_p50 = served_p50s(address, port, LONE)
    g32 = asyncio.run(grpc_32(address, seconds))
    h32 = asyncio.run(http_32(port, seconds))
    return {"gRPC 1 p50": grpc_p50, "HTTP 1 p50": http_p50, "gRPC 32/s": g32, "HTTP 32/s": h32}


def served(seconds: float) -> dict[str, float]:
    port = free_port()
    server = ServerProcess(
        ["--repository", "models", "--graph", "optimized", "--port", "0", "--metrics-port", "0",
         "--http-port", str(port)],
        Path("/tmp/ab-turns-serve.log"),
        engine=ENGINE,
    )  # fmt: skip
    with server:
        got = measure(server.wait_serving(), port, seconds)
        server.signal()
        server.wait()
    return got


def main(before: str, after: str, rounds: int, seconds: float) -> None:
    versions = {"before": before, "after": after}
    one_text = in_process() if ENGINE is None else None
    rows: dict[str, dict[str, list[float]]] = {v: {} for v in versions}
    refs: list[float] = []
    try:
        for r in range(rounds):
            names = list(versions) if r % 2 == 0 else list(reversed(versions))
            for name in names:
                subprocess.run(["git", "checkout", versions[name], "--", "service"], check=True)
                got = served(seconds)
                for k, v in got.items():
                    rows[name].setdefault(k, []).append(v)
                print(f"round {r} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
            refs.append(p50_ms(one_text, LONE) if ENGINE is None else float(ENGINE.split(":")[1]) * 1000)
            reference = f"reference (in process one at a time, or the engine's sleep) {refs[-1]:.2f} ms"
            print(f"round {r}: {reference}", flush=True)
    finally:
        subprocess.run(["git", "checkout", "HEAD", "--", "service"], check=True)
    ref = statistics.median(refs)
    print(f"medians of {rounds} rounds; reference {ref:.2f} ms")
    for name, row in rows.items():
        gaps = {k: [v - refs[i] for i, v in enumerate(vs)] for k, vs in row.items() if "p50" in k}
        print(
            f"{name} ({versions[name]}): "
            + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in row.items())
            + "; gaps to in process: "
            + ", ".join(f"{k} {statistics.median(v):+.2f}" for k, v in gaps.items())
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
