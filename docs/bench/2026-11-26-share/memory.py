"""Resident memory of `mhaserve serve` with one process, with two pinned ones (--intra-op-threads 1), and with
two that share the cores (the default for --processes on a CPU): after start-up, and after 32 clients sent
short texts for --seconds over gRPC (each client on its own channel, so both processes get some). The
supervisor and its server processes are summed. Run from the repository root:
python docs/bench/2026-11-26-share/memory.py SECONDS"""

import sys
import threading
import time
from pathlib import Path

import grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.testing.loopback import wait_until
from mhaserve.testing.process import Memory, ServerProcess, children, memory

TEXTS = [line for line in Path("loadtest/texts/short.txt").read_text().splitlines() if line.strip()]
CONFIGS = {
    "1 process": [],
    "2 processes, pinned (--intra-op-threads 1)": ["--processes", "2", "--intra-op-threads", "1"],
    "2 processes, sharing the cores": ["--processes", "2"],
}


def total(pid: int) -> Memory:
    return Memory.total([memory(p) for p in [pid, *children(pid, "mhaserve-p")]])


def load(address: str, seconds: float) -> int:
    stop, sent = time.perf_counter() + seconds, [0] * 32

    def user(i: int) -> None:
        with grpc.insecure_channel(address) as channel:
            stub, k = pb_grpc.EncoderServiceStub(channel), i
            while time.perf_counter() < stop:
                stub.Encode(pb.EncodeRequest(texts=[TEXTS[k % len(TEXTS)]], truncate=True), timeout=30)
                sent[i], k = sent[i] + 1, k + 32

    threads = [threading.Thread(target=user, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(sent)


for name, extra in CONFIGS.items():
    server = ServerProcess(
        ["--repository", "models", "--graph", "optimized", "--port", "0", "--metrics-port", "0", *extra],
        Path("/tmp/memory-serve.log"),
    )
    with server:
        server.wait_serving()
        if extra:
            wait_until(lambda s=server: "all 2 processes are serving" in s.log, "both processes to serve", 180)
        time.sleep(2)
        started = total(server.pid)
        n = load(server.address(), float(sys.argv[1]))
        after = total(server.pid)
        print(
            f"{name}: after start-up {started.rss_kib / 1024:.0f} MiB; after {n} requests {after.rss_kib / 1024:.0f} "
            f"MiB (peak {after.peak_kib / 1024:.0f} MiB)",
            flush=True,
        )
        server.signal()
        server.wait()
