"""Is a freshly started server slower on its first requests? One client, p50 by block of 100 requests.

Starts the server (defaults, the fused graph), sends one warm-up request, then the first 600 short texts
one at a time from a synchronous gRPC stub, three times over; prints each pass's p50 per block of 100.
Run from the repository root: python docs/bench/2026-11-26-nice/cold.py
"""

import statistics
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: one_client.py
from one_client import SHORT_TEXTS, latencies

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.testing.loopback import free_port
from mhaserve.testing.process import ServerProcess

TEXTS, BLOCK, PASSES = SHORT_TEXTS[:600], 100, 3


def main() -> None:
    flags = ["--repository", "models", "--graph", "optimized", "--port", "0", "--metrics-port", "0",
             "--http-port", str(free_port())]  # fmt: skip
    with ServerProcess(flags, Path("/tmp/cold-serve.log")) as server:
        address = server.wait_serving()
        with grpc.insecure_channel(address) as channel:
            stub = pbg.EncoderServiceStub(channel)
            stub.Encode(pb.EncodeRequest(texts=["warm up"], truncate=True))
            for p in range(PASSES):
                ms = [
                    1000 * s
                    for s in latencies(lambda t: stub.Encode(pb.EncodeRequest(texts=[t], truncate=True)), TEXTS)
                ]
                blocks = (statistics.median(ms[i : i + BLOCK]) for i in range(0, len(ms), BLOCK))
                print(f"pass {p}: p50 by block of {BLOCK}: " + " ".join(f"{b:.2f}" for b in blocks), flush=True)
        server.signal()
        server.wait()


if __name__ == "__main__":
    main()
