"""A/B of the code itself: the server as of d6d6eec (a synchronous readiness gate) against HEAD (the gate
is a coroutine, DataPlane.admission, for --loading-wait), alternated in rounds. Each round checks out
each version's service/ files (the editable install serves them), starts the server, and measures one
synchronous client's p50 over 300 short texts, then 32 synchronous clients (threads) for 12 s. The
working tree's service/ is restored at the end."""

import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.testing.process import ServerProcess

TEXTS = [line for line in Path("loadtest/texts/short.txt").read_text().splitlines() if line.strip()]
VERSIONS = {"d6d6eec": "d6d6eec", "HEAD": "HEAD"}


def one_client(stub) -> float:
    latencies = []
    for text in TEXTS[:300]:
        t0 = time.perf_counter()
        stub.Encode(pb.EncodeRequest(texts=[text], truncate=True))
        latencies.append(time.perf_counter() - t0)
    return 1000 * statistics.median(latencies)


def clients_32(address: str, seconds: float) -> float:
    stop = time.time() + seconds
    done = [0] * 32

    def user(i: int) -> None:
        with grpc.insecure_channel(address) as channel:
            stub = pbg.EncoderServiceStub(channel)
            k = i
            while time.time() < stop:
                stub.Encode(pb.EncodeRequest(texts=[TEXTS[k % len(TEXTS)]], truncate=True))
                done[i] += 1
                k += 32

    threads = [threading.Thread(target=user, args=(i,)) for i in range(32)]
    started = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.time() - started)


results: dict[str, dict[str, list[float]]] = {v: {"p50": [], "seq/s": []} for v in VERSIONS}
try:
    for r in range(int(sys.argv[1])):
        for name in list(VERSIONS) if r % 2 == 0 else list(reversed(VERSIONS)):
            subprocess.run(["git", "checkout", VERSIONS[name], "--", "service"], check=True)
            proc = ServerProcess(
                ["--repository", "models", "--port", "0", "--metrics-port", "0", "--device", "cpu"],
                Path("ab-server.log"),
            )
            try:
                address = proc.wait_serving()
                with grpc.insecure_channel(address) as channel:
                    stub = pbg.EncoderServiceStub(channel)
                    for _ in range(20):
                        stub.Encode(pb.EncodeRequest(texts=["warm up"], truncate=True))
                    results[name]["p50"].append(one_client(stub))
                results[name]["seq/s"].append(clients_32(address, 12.0))
            finally:
                proc.signal()
                proc.wait()
            print(
                f"round {r} {name}: one client p50 {results[name]['p50'][-1]:.2f} ms, "
                f"32 clients {results[name]['seq/s'][-1]:.1f} seq/s",
                flush=True,
            )
finally:
    subprocess.run(["git", "checkout", "HEAD", "--", "service"], check=True)
for name, figures in results.items():
    print(f"{name}: medians of rounds: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in figures.items()))
