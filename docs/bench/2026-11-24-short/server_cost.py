"""Per-request CPU of our server, by thread, under N closed-loop aio clients sending one short text."""

import asyncio
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.testing.loopback import free_ports

TEXTS = [f"what is the best way to cook rice number {i} quickly" for i in range(500)]


def threads(pid):
    out: collections.Counter[str] = collections.Counter()
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
            f = Path(f"/proc/{pid}/task/{t}/stat").read_text().split(")")[1].split()
        except OSError:
            continue
        name = name.rstrip("0123456789-_") or name
        out[name] += (int(f[11]) + int(f[12])) * 1000 // os.sysconf("SC_CLK_TCK")  # ms
    return out


async def load(addr, n, seconds, raw):
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pbg.EncoderServiceStub(ch)
        stop = time.monotonic() + seconds
        count = 0

        async def one(k):
            nonlocal count
            i = k
            while time.monotonic() < stop:
                await stub.Encode(pb.EncodeRequest(texts=[TEXTS[i % 500]]))
                count += 1
                i += 32

        await asyncio.gather(*(one(k) for k in range(n)))
        return count


def main():
    repo, model, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    extra = sys.argv[4:]
    port, mport, hport = free_ports(3)
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mhaserve.cli",
            "serve",
            "--repository",
            repo,
            "--model",
            model,
            "--port",
            str(port),
            "--metrics-port",
            str(mport),
            "--http-port",
            str(hport),
            "--device",
            "cpu",
            *extra,
        ],
        stdout=Path("server.log").open("w"),  # noqa: SIM115 (the server holds it until it exits)
        stderr=subprocess.STDOUT,
    )
    addr = f"127.0.0.1:{port}"
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(addr) as ch:
        for _ in range(300):
            try:
                if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    asyncio.run(load(addr, n, 2.0, 0))
    for _ in range(2):
        a, t0 = threads(p.pid), time.monotonic()
        count = asyncio.run(load(addr, n, 6.0, 0))
        dt = time.monotonic() - t0
        b = threads(p.pid)
        d = {k: (b[k] - a.get(k, 0)) / count for k in b if b[k] - a.get(k, 0) > 5}  # ms per request
        print(
            f"req/s={count / dt:6.0f} total_ms/req={sum(d.values()):.3f} "
            + " ".join(f"{k}={v:.3f}" for k, v in sorted(d.items(), key=lambda x: -x[1]))
        )
    p.terminate()
    p.wait()


main()
