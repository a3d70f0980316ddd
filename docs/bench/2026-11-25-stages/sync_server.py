"""The bare round trip again, grpcio's synchronous server (a thread pool) against grpc.aio's, the same
trivial Encode handler and synchronous client: p50 of 1,500 calls, 6 alternated rounds."""

import asyncio
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import grpc.aio

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg

RESPONSE = pb.EncodeResponse(embeddings=[pb.Embedding(values=[0.1] * 384)])


class SyncServicer(pbg.EncoderServiceServicer):
    def Encode(self, request, context):
        return RESPONSE


class AioServicer(pbg.EncoderServiceServicer):
    async def Encode(self, request, context):
        return RESPONSE


def run_aio(port: list[int], ready: threading.Event, stop: threading.Event) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        pbg.add_EncoderServiceServicer_to_server(AioServicer(), server)
        port.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        await asyncio.to_thread(stop.wait)
        await server.stop(0)

    asyncio.run(main())


def measure(address: str) -> float:
    with grpc.insecure_channel(address) as channel:
        stub = pbg.EncoderServiceStub(channel)
        for _ in range(50):
            stub.Encode(pb.EncodeRequest(texts=["x"]))
        latencies = []
        for _ in range(1500):
            t0 = time.perf_counter()
            stub.Encode(pb.EncodeRequest(texts=["a short query text"]))
            latencies.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(latencies)


results: dict[str, list[float]] = {"sync": [], "aio": []}
for r in range(6):
    for kind in ("sync", "aio") if r % 2 == 0 else ("aio", "sync"):
        if kind == "sync":
            server = grpc.server(ThreadPoolExecutor(4))
            pbg.add_EncoderServiceServicer_to_server(SyncServicer(), server)
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            value = measure(f"127.0.0.1:{port}")
            server.stop(0)
        else:
            ports: list[int] = []
            ready, stop = threading.Event(), threading.Event()
            thread = threading.Thread(target=run_aio, args=(ports, ready, stop))
            thread.start()
            ready.wait()
            value = measure(f"127.0.0.1:{ports[0]}")
            stop.set()
            thread.join()
        results[kind].append(value)
    print(r, {k: round(v[-1]) for k, v in results.items()}, flush=True)
print("medians of rounds (us):", {k: round(statistics.median(v)) for k, v in results.items()})
