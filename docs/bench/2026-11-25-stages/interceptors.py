"""A bare grpc.aio server with a trivial Encode handler (a 384-float answer) and a synchronous client in the
same process: p50 of 1,500 calls with no interceptor against two pass-through interceptors that rewrap the
handler as ours do, alternated 8 times."""

import asyncio
import statistics
import threading
import time

import grpc
import grpc.aio

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.service.rpc.handlers import behaviour, rewrap

RESPONSE = pb.EncodeResponse(embeddings=[pb.Embedding(values=[0.1] * 384)])


class Servicer(pbg.EncoderServiceServicer):
    async def Encode(self, request, context):
        return RESPONSE


class PassThrough(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        inner = behaviour(handler)

        async def wrapper(request, context):
            return await inner(request, context)

        return rewrap(handler, wrapper)


def serve(n: int, port: list[int], ready: threading.Event, stop: threading.Event) -> None:
    async def main() -> None:
        server = grpc.aio.server(interceptors=[PassThrough() for _ in range(n)] or None)
        pbg.add_EncoderServiceServicer_to_server(Servicer(), server)
        port.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        await asyncio.to_thread(stop.wait)
        await server.stop(0)

    asyncio.run(main())


results: dict[int, list[float]] = {0: [], 2: []}
for _ in range(8):
    for n in (0, 2):
        port: list[int] = []
        ready, stop = threading.Event(), threading.Event()
        thread = threading.Thread(target=serve, args=(n, port, ready, stop))
        thread.start()
        ready.wait()
        with grpc.insecure_channel(f"127.0.0.1:{port[0]}") as channel:
            stub = pbg.EncoderServiceStub(channel)
            for _ in range(50):
                stub.Encode(pb.EncodeRequest(texts=["x"]))
            latencies = []
            for _ in range(1500):
                t0 = time.perf_counter()
                stub.Encode(pb.EncodeRequest(texts=["a short query text"]))
                latencies.append(time.perf_counter() - t0)
        stop.set()
        thread.join()
        results[n].append(1e6 * statistics.median(latencies))
        print(f"{n} interceptors: p50 {results[n][-1]:.0f} us", flush=True)
print({n: f"median of rounds {statistics.median(v):.0f} us" for n, v in results.items()})
