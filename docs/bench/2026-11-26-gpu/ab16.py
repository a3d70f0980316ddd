"""Server settings on a many-core CPU: for each set of `mhaserve serve` flags, a fresh server on the CPU,
32 synchronous gRPC clients (threads) sending the short texts one per request for --seconds, then one
client for half that; prints seq/s, p50 / p99 and the server's CPU (cores busy)."""

import os
import sys
import threading
import time
from pathlib import Path

import grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.testing.process import ServerProcess

repo, seconds = sys.argv[1], float(sys.argv[2])
CONFIGS = [c.split() for c in sys.argv[3:]]
TEXTS = [line for line in Path("loadtest/texts/short.txt").read_text().splitlines() if line.strip()]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def load(address: str, clients: int, secs: float) -> tuple[float, float, float]:
    latencies: list[float] = []
    stop = time.time() + secs

    def user(first: int) -> None:
        with grpc.insecure_channel(address) as channel:
            stub = pbg.EncoderServiceStub(channel)
            k = first
            while time.time() < stop:
                t0 = time.perf_counter()
                stub.Encode(pb.EncodeRequest(texts=[TEXTS[k % len(TEXTS)]], truncate=True))
                latencies.append(time.perf_counter() - t0)
                k += clients

    threads = [threading.Thread(target=user, args=(i,)) for i in range(clients)]
    started = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lat = sorted(latencies)
    n = len(lat)
    return n / (time.time() - started), 1000 * lat[n // 2], 1000 * lat[int(0.99 * n)]


print("flags | 32 clients seq/s | p50 ms | p99 ms | server cores | 1 client seq/s | p50 ms | p99 ms")
for flags in CONFIGS:
    proc = ServerProcess(
        ["--repository", repo, "--port", "0", "--metrics-port", "0", "--device", "cpu", *flags],
        Path("/tmp/ab16-server.log"),
    )
    address = proc.wait_serving()
    load(address, 32, 1.0)  # warm the channels and the arenas
    c0, t0 = cpu_seconds(proc.pid), time.time()
    many = load(address, 32, seconds)
    cores = (cpu_seconds(proc.pid) - c0) / (time.time() - t0)
    one = load(address, 1, seconds / 2)
    proc.signal()
    proc.wait()
    print(
        f"{' '.join(flags) or '(defaults)'} | {many[0]:.1f} | {many[1]:.2f} | {many[2]:.1f} | {cores:.1f} | "
        f"{one[0]:.1f} | {one[1]:.2f} | {one[2]:.2f}",
        flush=True,
    )
