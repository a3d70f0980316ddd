"""32 synchronous gRPC clients (threads) send the short texts to a server started for the run, for the
seconds given; prints the requests, their rate and p99."""

import sys
import threading
import time
from pathlib import Path

import grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.testing.process import ServerProcess

TEXTS = [line for line in Path("loadtest/texts/short.txt").read_text().splitlines() if line.strip()]
proc = ServerProcess(
    ["--repository", "models", "--port", "0", "--metrics-port", "0", "--device", "cpu"], Path("load32-server.log")
)
address = proc.wait_serving()
stop = time.time() + float(sys.argv[1])
latencies: list[float] = []


def user(first: int) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = pbg.EncoderServiceStub(channel)
        k = first
        while time.time() < stop:
            t0 = time.perf_counter()
            stub.Encode(pb.EncodeRequest(texts=[TEXTS[k % len(TEXTS)]], truncate=True))
            latencies.append(time.perf_counter() - t0)
            k += 32


threads = [threading.Thread(target=user, args=(i,)) for i in range(32)]
started = time.time()
for t in threads:
    t.start()
for t in threads:
    t.join()
n = len(latencies)
print(f"{n} requests, {n / (time.time() - started):.1f}/s, p99 {1000 * sorted(latencies)[int(0.99 * n)]:.0f} ms")
proc.signal()
proc.wait()
print("server pid", proc.pid)
