"""What registered methods cost grpc.aio's server by themselves: an empty server with the same four services
as ours (encoder.v1, the Open Inference Protocol, health, reflection: 20 methods), added as the generated
stubs add them ("registered": a generic handler and registered methods) or through GenericOnly
("generic": the generic handler only, service/rpc/registration.py). `Encode` answers one 384-float
embedding at once; there are no interceptors and no model.

Each round starts each server afresh, alternated, and measures 32 grpc.aio clients on one channel for
SECONDS (calls a second, the server's CPU per call) and then one synchronous client, 1,000 calls one at a
time (p50); the clients are floor_load.py's and one_client.py's. Run from the repository root:
  python docs/bench/2026-11-26-generic/registered.py ROUNDS SECONDS
"""

import asyncio
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import grpc.aio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: one_client.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-floor"))
from floor_load import load
from one_client import SHORT_TEXTS, p50_ms

from mhaserve.loadtest.bench.quiet import process_cpu_seconds
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.proto.inference.v2 import grpc_service_pb2_grpc as kserve_grpc
from mhaserve.service.client import CHANNEL_OPTIONS
from mhaserve.service.health import Health
from mhaserve.service.rpc.reflection import add_reflection
from mhaserve.service.rpc.registration import GenericOnly
from mhaserve.testing.loopback import free_port

EMBEDDING = [0.01 * i for i in range(384)]


class Echo(pbg.EncoderServiceServicer):
    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext) -> pb.EncodeResponse:  # type: ignore[type-arg]
        return pb.EncodeResponse(embeddings=[pb.Embedding(values=EMBEDDING)], model="echo", model_version=1)


async def serve(mode: str, port: int) -> None:
    server = grpc.aio.server()
    services = GenericOnly(server) if mode == "generic" else server
    pbg.add_EncoderServiceServicer_to_server(Echo(), services)
    kserve_grpc.add_GRPCInferenceServiceServicer_to_server(kserve_grpc.GRPCInferenceServiceServicer(), services)
    health = Health([])
    health.add_to(services)  # type: ignore[arg-type]
    add_reflection(services, ("encoder.v1.EncoderService",))  # type: ignore[arg-type]
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def measure(mode: str, seconds: float) -> tuple[float, float, float]:
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "serve", mode, str(port)])
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        # floor_load's 32 clients on one channel, calling Encode as they would call our server ("-ours")
        asyncio.run(load("grpc-ours", port, port, 1.0))  # warm up
        cpu0, t0 = process_cpu_seconds(server.pid), time.perf_counter()
        calls = asyncio.run(load("grpc-ours", port, port, seconds))
        elapsed, cpu = time.perf_counter() - t0, process_cpu_seconds(server.pid) - cpu0
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            encode = pbg.EncoderServiceStub(channel).Encode
            p50_ms(lambda t: encode(pb.EncodeRequest(texts=[t])), SHORT_TEXTS[:100])  # warm up
            p50 = p50_ms(lambda t: encode(pb.EncodeRequest(texts=[t])), SHORT_TEXTS[100:1100])
    finally:
        server.terminate()
        server.wait()
    return calls / elapsed, cpu / calls * 1e6, p50


def main(rounds: int, seconds: float) -> None:
    modes = ["registered", "generic"]
    rows: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else list(reversed(modes)):
            rows[mode].append(measure(mode, seconds))
            rate, cpu, p50 = rows[mode][-1]
            print(f"round {r} {mode}: 32 clients {rate:.0f}/s, {cpu:.0f} us CPU a call; one client {p50:.3f} ms",
                  flush=True)  # fmt: skip
    print("medians of the rounds, and generic against registered in the same round (median of the ratios):")
    for mode in modes:
        rate, cpu, p50 = (statistics.median(c) for c in zip(*rows[mode], strict=True))
        print(f"  {mode:10s} {rate:6.0f}/s  {cpu:5.0f} us CPU a call  one client {p50:.3f} ms")
    pairs = zip(rows["generic"], rows["registered"], strict=True)
    ratios = [[g / b for g, b in zip(gr, br, strict=True)] for gr, br in pairs]
    rate, cpu, p50 = (statistics.median(c) for c in zip(*ratios, strict=True))
    print(f"  generic / registered: calls a second {rate:.3f}, CPU a call {cpu:.3f}, one client p50 {p50:.3f}")


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        asyncio.run(serve(sys.argv[2], int(sys.argv[3])))
    else:
        main(int(sys.argv[1]), float(sys.argv[2]))
