"""Where the event loop's time goes under N closed-loop clients sending short texts (grpc.aio, or the bench's
HTTP connections with POST /v1/embeddings): py-spy samples the server (defaults, fused graph) without stopping
it, and the main thread's samples are sorted into waiting (epoll), compiled callbacks (a stack that ends in
asyncio's Handle._run: grpc.aio's Cython, or uvicorn's httptools parser, which py-spy cannot see), tokenising,
our own Python, and the rest. Needs py-spy (`pip install py-spy`) and the ptrace permission to attach. Run
from the repository root:
  python docs/bench/2026-11-29-twentyfourth/loop_profile.py CLIENTS SECONDS OUT.raw [grpc|http]
"""

import asyncio
import collections
import subprocess
import sys
import time
from pathlib import Path

import grpc.aio

from mhaserve.loadtest.bench.transports import HttpConnection, call, http_request
from mhaserve.loadtest.bench.workloads import load_corpus
from mhaserve.loadtest.texts import SHORT
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.testing.loopback import free_ports
from mhaserve.testing.process import ServerProcess

OURS = ("EncoderServicer", "interceptors", "dataplane", "pipeline", "batching", "metrics", "service/http", "openai")


async def client(stub: pbg.EncoderServiceStub, texts: list[str], first: int, step: int, stop: float) -> int:
    k, sent = first, 0
    while time.monotonic() < stop:
        await stub.Encode(pb.EncodeRequest(texts=[texts[k % len(texts)]], truncate=True), timeout=60)
        k += step
        sent += 1
    return sent


async def load(address: str, texts: list[str], clients: int, seconds: float) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pbg.EncoderServiceStub(channel)
        stop = time.monotonic() + seconds
        return sum(await asyncio.gather(*(client(stub, texts, i, clients, stop) for i in range(clients))))


async def http_client(port: int, texts: list[str], first: int, step: int, stop: float) -> int:
    connection, k, sent = HttpConnection("127.0.0.1", port), first, 0
    while time.monotonic() < stop:
        await call(connection, http_request("127.0.0.1", texts[k % len(texts)], "float"), 1)
        k += step
        sent += 1
    connection.close()
    return sent


async def http_load(port: int, texts: list[str], clients: int, seconds: float) -> int:
    stop = time.monotonic() + seconds
    return sum(await asyncio.gather(*(http_client(port, texts, i, clients, stop) for i in range(clients))))


def categories(raw: Path) -> tuple[int, collections.Counter[str]]:
    """The main thread's samples: how many in all, and by category."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if "MainThread" not in frames[0]:
            continue
        rest, leaf = ";".join(frames[1:]), frames[-1]
        if "EpollSelector.select" in leaf:
            kind = "waiting in epoll"
        elif "_tokenize" in rest:
            kind = "tokenising"
        elif any(o in rest for o in OURS):
            kind = "ours: servicer, interceptors, data plane, batcher, metrics"
        elif leaf.startswith("Handle._run"):
            kind = "compiled callbacks (grpc.aio's or httptools')"
        else:
            kind = "other Python (asyncio)"
        counts[kind] += int(n)
    return sum(counts.values()), counts


def main() -> None:
    clients, seconds, out = int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
    protocol = sys.argv[4] if len(sys.argv) > 4 else "grpc"
    texts = load_corpus(SHORT)
    grpc_port, http_port = free_ports(2)
    flags = ["--repository", "models", "--graph", "optimized", "--port", str(grpc_port), "--http-port", str(http_port)]
    with ServerProcess([*flags, "--metrics-port", "0"], out.with_suffix(".log")) as server:
        address = server.wait_serving()

        def run(seconds: float) -> int:
            if protocol == "http":
                return asyncio.run(http_load(http_port, texts, clients, seconds))
            return asyncio.run(load(address, texts, clients, seconds))

        run(3)  # warm
        spy = [str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(server.pid), "--nonblocking"]
        spy += ["-d", str(int(seconds - 4)), "-r", "250", "--threads", "-f", "raw", "-o", str(out)]
        sampler = subprocess.Popen(spy, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sent = run(seconds)
        sampler.wait()
        server.signal()
        server.wait()
    total, counts = categories(out)
    busy = total - counts["waiting in epoll"]
    print(
        f"{clients} {protocol} clients: {sent / seconds:.1f} requests/s; the main thread's samples {total}, busy {busy}"
    )
    for kind, n in counts.most_common():
        share = "" if kind == "waiting in epoll" else f" ({100 * n / busy:.0f} % of the busy ones)"
        print(f"  {kind}: {n}{share}")


if __name__ == "__main__":
    main()
