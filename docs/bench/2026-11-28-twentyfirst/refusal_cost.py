"""What a refusal costs the server: a `mhaserve serve` process with the tests' scripted engine holding one batch
(`hang:99`) and a queue of one input, kept full, answers N one-text Encode calls from one synchronous stub with
RESOURCE_EXHAUSTED; the server's CPU (user + system, /proc) a call and the client's p50, beside an empty grpc.aio
server (loadtest/bench/empty.py, the same client, no delay) answering the same calls. Alternated rounds, each
server started afresh. Run from the repository root:
  python docs/bench/2026-11-28-twentyfirst/refusal_cost.py ROUNDS CALLS [EXTRA SERVE FLAGS...]
"""

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.testing.loopback import free_port, wait_until

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def calls(stub: pb_grpc.EncoderServiceStub, n: int, expect: grpc.StatusCode | None) -> list[float]:
    out = []
    request = pb.EncodeRequest(texts=["a short query about the weather"])
    for _ in range(n):
        t = time.perf_counter()
        try:
            stub.Encode(request, timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        out.append(time.perf_counter() - t)
        if expect is not None and code != expect:
            raise RuntimeError(f"expected {expect}, got {code}")
    return out


def measure(proc: subprocess.Popen[bytes], port: int, n: int, expect: grpc.StatusCode | None) -> tuple[float, float]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        calls(stub, 200, expect)  # warm
        before = cpu_seconds(proc.pid)
        lat = calls(stub, n, expect)
        used = cpu_seconds(proc.pid) - before
    return used / n * 1e6, statistics.median(lat) * 1e3


def ours(n: int, extra: list[str]) -> tuple[float, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "mhaserve.testing.fake_server", "--engine", "hang:99", "--repository", "models",
           "--port", str(port), "--http-port", "0", "--metrics-port", "0", "--max-queue-size", "1",
           "--inference-workers", "1", "--max-wait-ms", "0", "--max-client-batch-size", "1", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.EncoderServiceStub(channel)
        wait_until(lambda: _serving(stub), "the server", timeout=60)
        held = stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[99, 5])]), timeout=600)
        time.sleep(0.5)
        queued = stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[7, 5])]), timeout=600)
        time.sleep(0.5)
        result = measure(proc, port, n, grpc.StatusCode.RESOURCE_EXHAUSTED)
        proc.send_signal(signal.SIGUSR1)
        held.result(), queued.result()
        channel.close()
        return result
    finally:
        proc.kill()
        proc.wait()


def _serving(stub: pb_grpc.EncoderServiceStub) -> bool:
    try:
        stub.Encode(pb.EncodeRequest(texts=["x"]), timeout=2)
        return True
    except grpc.RpcError:
        return False


def empty(n: int) -> tuple[float, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "mhaserve.loadtest.bench.empty", str(port), str(free_port()), "384", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        stub = pb_grpc.EncoderServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        wait_until(lambda: _serving(stub), "the empty server", timeout=60)
        return measure(proc, port, n, grpc.StatusCode.OK)
    finally:
        proc.kill()
        proc.wait()


def main(rounds: int, n: int, extra: list[str]) -> None:
    got: dict[str, list[tuple[float, float]]] = {"empty grpc.aio, answering": [], "ours, refusing": []}
    for r in range(rounds):
        order = list(got) if r % 2 == 0 else list(reversed(got))
        for name in order:
            got[name].append(empty(n) if name.startswith("empty") else ours(n, extra))
            print(f"round {r} {name}: {got[name][-1][0]:.0f} us of server CPU a call, p50 {got[name][-1][1]:.3f} ms",
                  flush=True)  # fmt: skip
    print(f"\nmedians of {rounds} rounds of {n} calls:")
    for name, v in got.items():
        cpu, p50 = statistics.median(c for c, _ in v), statistics.median(p for _, p in v)
        print(f"  {name}: {cpu:.0f} us a call, p50 {p50:.3f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
