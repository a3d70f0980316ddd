"""One client's p50 against one running server, by client: is the bench's one-client gap the server's?

One server (defaults, the fused graph), then per round, one after another, 300 short texts one at a time
(from OFFSET in loadtest/texts/short.txt) from:
- a synchronous gRPC stub, and `http.client` on one keep-alive connection (one_client.served_p50s);
- a grpc.aio stub on one channel, as the bench's gRPC client, without and with a deadline (the bench sends
  `timeout=120`);
- the bench's raw asyncio HTTP/1.1 connection (one_client.http_latencies);
and ONNX Runtime in this process on the same texts one at a time (the reference of the one-client target).
Run from the repository root: python docs/bench/2026-11-26-nice/clients.py ROUNDS OFFSET
"""

import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: one_client.py
from one_client import SHORT_TEXTS, http_latencies, in_process, p50_ms, served_p50s

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.service.client import CHANNEL_OPTIONS
from mhaserve.testing.loopback import free_port
from mhaserve.testing.process import ServerProcess


async def aio_grpc(address: str, texts: list[str], deadline: float | None = None) -> float:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pbg.EncoderServiceStub(channel)
        for _ in range(20):
            await stub.Encode(pb.EncodeRequest(texts=["warm up"], truncate=True))
        out = []
        for t in texts:
            t0 = time.perf_counter()
            await stub.Encode(pb.EncodeRequest(texts=[t], truncate=True), timeout=deadline)
            out.append(time.perf_counter() - t0)
        return 1000 * statistics.median(out)


def main(rounds: int, offset: int) -> None:
    texts = SHORT_TEXTS[offset : offset + 300]
    one = in_process()
    port = free_port()
    flags = ["--repository", "models", "--graph", "optimized", "--port", "0", "--metrics-port", "0",
             "--http-port", str(port)]  # fmt: skip
    rows: dict[str, list[float]] = {
        k: [] for k in ("sync gRPC", "aio gRPC", "aio gRPC, deadline", "http.client", "aio HTTP", "in process")
    }
    with ServerProcess(flags, Path("/tmp/clients-serve.log")) as server:
        address = server.wait_serving()
        for r in range(rounds):
            grpc_p50, http_p50 = served_p50s(address, port, texts)
            rows["sync gRPC"].append(grpc_p50)
            rows["http.client"].append(http_p50)
            rows["aio gRPC"].append(asyncio.run(aio_grpc(address, texts)))
            rows["aio gRPC, deadline"].append(asyncio.run(aio_grpc(address, texts, 120.0)))
            rows["aio HTTP"].append(1000 * statistics.median(asyncio.run(http_latencies(port, texts))))
            rows["in process"].append(p50_ms(one, texts))
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rows.items()), flush=True)
        server.signal()
        server.wait()
    print("p50 ms, medians: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in rows.items()))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
