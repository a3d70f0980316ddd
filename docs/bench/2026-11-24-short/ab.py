"""A/B of serve flags on the short corpus at N clients: alternating rounds, req/s and mean batch size."""

import asyncio
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.testing.loopback import free_ports

TEXTS = [line.rstrip("\n") for line in Path("loadtest/texts/short.txt").read_text().splitlines() if line.strip()]
random.Random(0).shuffle(TEXTS)


LOG = Path("server.log").open("a")  # noqa: SIM115 (every server of the run writes here)


def metric(mport, name):
    body = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics").read().decode()
    s = c = 0.0
    for line in body.splitlines():
        if line.startswith(name + "_sum"):
            s += float(line.split()[-1])
        if line.startswith(name + "_count"):
            c += float(line.split()[-1])
    return s, c


async def load(addr, n, seconds):
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pbg.EncoderServiceStub(ch)
        stop = time.monotonic() + seconds
        count = 0

        async def one(k):
            nonlocal count
            i = k * 61
            while time.monotonic() < stop:
                await stub.Encode(pb.EncodeRequest(texts=[TEXTS[i % len(TEXTS)]], truncate=True))
                count += 1
                i += 1

        await asyncio.gather(*(one(k) for k in range(n)))
        return count


def start(repo, model, extra):
    env = dict(os.environ)
    for e in [x for x in extra if x.startswith("ENV:")]:
        k, v = e[4:].split("=", 1)
        env[k] = v
    extra = [x for x in extra if not x.startswith("ENV:")]
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
        stdout=LOG,
        stderr=subprocess.STDOUT,
        env=env,
    )
    addr = f"127.0.0.1:{port}"
    with grpc.insecure_channel(addr) as ch:
        for _ in range(600):
            try:
                if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return p, addr, mport


def main():
    repo, model, n, rounds, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    configs = [c.split() for c in sys.argv[6:]]
    res: dict[int, list[float]] = {i: [] for i in range(len(configs))}
    for r in range(rounds):
        order = list(range(len(configs)))
        order = order[r % len(order) :] + order[: r % len(order)]
        for i in order:
            p, addr, mport = start(repo, model, configs[i])
            asyncio.run(load(addr, n, 3.0))
            b0 = metric(mport, "mhaserve_batch_size")
            p0 = metric(mport, "mhaserve_padding_fraction")
            t0 = time.monotonic()
            count = asyncio.run(load(addr, n, secs))
            dt = time.monotonic() - t0
            b1 = metric(mport, "mhaserve_batch_size")
            p1 = metric(mport, "mhaserve_padding_fraction")
            mean_b = (b1[0] - b0[0]) / max(1, b1[1] - b0[1])
            res[i].append(count / dt)
            padding = (p1[0] - p0[0]) / max(1, p1[1] - p0[1])
            name = " ".join(configs[i]) or "default"
            print(
                f"round {r} config {i} {name}: {count / dt:6.1f} seq/s, mean batch {mean_b:.1f} padding {padding:.3f}"
            )
            p.terminate()
            p.wait()
    import statistics

    for i, c in enumerate(configs):
        name = " ".join(c) or "default"
        print(f"config {i} {name}: median {statistics.median(res[i]):.1f}  all {[round(x, 1) for x in res[i]]}")


main()
