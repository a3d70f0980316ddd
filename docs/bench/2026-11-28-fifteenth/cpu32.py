"""Our server's CPU a request at 32 gRPC clients (short texts, one a request), by thread, optionally under py-spy.

Starts `mhaserve serve` (ENGINE `model`) or the test harness's server with a scripted engine (ENGINE e.g.
`slow:0.005`: 5 ms asleep a batch, no model), the fused graph's entry, warms up for 2 s, then 32 grpc.aio
clients on one channel for 6 s; prints requests a second and the server's CPU a request for each thread name
(from /proc). With SPY=FILE, py-spy (at $PY_SPY, default /tmp/pyspy/bin/py-spy) records those 6 s of every
thread (raw format, idle frames left out); ../2026-11-27-fourteenth/agg.py reads it.
Run from the repository root: python docs/bench/2026-11-28-fifteenth/cpu32.py ENGINE [SERVE FLAG ...]
"""

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.testing.loopback import free_ports

TEXTS = [t for t in Path("loadtest/texts/short.txt").read_text().splitlines() if t.strip()]
TICK = os.sysconf("SC_CLK_TCK")
LOG = Path("/tmp/cpu32-serve.log")


def by_thread(pid: int) -> dict[str, float]:
    """CPU seconds of each thread name (digits and separators at the end dropped: one entry a pool)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip().rstrip("0123456789_-")
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


async def load(port: int, clients: int, seconds: float) -> tuple[int, float]:
    requests = [pb.EncodeRequest(texts=[t], truncate=True) for t in TEXTS]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pbg.EncoderServiceStub(channel)
        stop = time.perf_counter() + seconds

        async def user(i: int) -> int:
            n, k = 0, i
            while time.perf_counter() < stop:
                await stub.Encode(requests[k % len(requests)])
                n, k = n + 1, k + clients
            return n

        t0 = time.perf_counter()
        n = sum(await asyncio.gather(*(user(i) for i in range(clients))))
        return n, time.perf_counter() - t0


def main(engine: str, flags: list[str]) -> None:
    port, metrics_port, http_port = free_ports(3)
    command = [sys.executable, "-m", "mhaserve.cli.main", "serve"] if engine == "model" else [
        sys.executable, "-m", "mhaserve.testing.fake_server", "--engine", engine]  # fmt: skip
    command += ["--repository", "models", "--graph", "optimized", "--port", str(port), "--metrics-port",
                str(metrics_port), "--http-port", str(http_port), *flags]  # fmt: skip
    with LOG.open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while "inference worker" not in LOG.read_text():
        if server.poll() is not None or time.time() > deadline:
            raise RuntimeError(LOG.read_text())
        time.sleep(0.2)
    asyncio.run(load(port, 32, 2))
    before = by_thread(server.pid)
    spy = None
    if out := os.environ.get("SPY"):
        py_spy = os.environ.get("PY_SPY", "/tmp/pyspy/bin/py-spy")
        spy = subprocess.Popen([py_spy, "record", "-p", str(server.pid), "-d", "7", "-r", "500", "-f", "raw", "-o",
                                out, "--threads", "--nonblocking"], stdout=subprocess.DEVNULL)  # fmt: skip
    n, elapsed = asyncio.run(load(port, 32, 6))
    after = by_thread(server.pid)
    if spy is not None:
        spy.wait(30)
    server.send_signal(2)
    server.wait(30)
    used = {name: after[name] - before.get(name, 0.0) for name in after}
    total = sum(used.values())
    threads = ", ".join(f"{name} {s / n * 1e6:.0f}" for name, s in sorted(used.items(), key=lambda x: -x[1]) if s > 0)
    print(f"{engine} {' '.join(flags)}: {n / elapsed:.0f} requests/s, server CPU {total / n * 1e6:.0f} us a request "
          f"(by thread: {threads})")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
