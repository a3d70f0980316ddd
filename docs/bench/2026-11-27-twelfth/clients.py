"""One client's p50 against one server (defaults, fused graph), less ONNX Runtime's one text at a time in process:
from a synchronous stub, from grpc.aio (the bench's client) and over HTTP (the bench's), in rounds whose order
rotates. Run from the repository root:
  python docs/bench/2026-11-27-twelfth/clients.py ROUNDS TEXTS
"""

import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import grpc.aio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import one_client as oc  # noqa: E402

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb  # noqa: E402
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg  # noqa: E402
from mhaserve.testing.loopback import free_ports  # noqa: E402
from mhaserve.testing.process import ServerProcess  # noqa: E402


async def aio_p50(address: str, texts: list[str]) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pbg.EncoderServiceStub(channel)
        requests = [pb.EncodeRequest(texts=[t], truncate=True) for t in texts]
        for _ in range(20):
            await stub.Encode(requests[0])
        out = []
        for r in requests:
            t0 = time.perf_counter()
            await stub.Encode(r, timeout=120)
            out.append(time.perf_counter() - t0)
    return 1000 * statistics.median(out)


def sync_p50(address: str, texts: list[str]) -> float:
    with grpc.insecure_channel(address) as channel:
        stub = pbg.EncoderServiceStub(channel)
        for _ in range(20):
            stub.Encode(pb.EncodeRequest(texts=["warm up"], truncate=True))
        return oc.p50_ms(lambda t: stub.Encode(pb.EncodeRequest(texts=[t], truncate=True), timeout=120), texts)


async def http_p50(port: int, texts: list[str]) -> float:
    await oc.http_latencies(port, texts[:20])
    return 1000 * statistics.median(await oc.http_latencies(port, texts))


def setup(texts: list[str]) -> tuple[list[str], Callable[[str], None], dict[str, Callable[[], float]]]:
    """The server's flags (defaults, fused graph, free ports), ONNX Runtime's one text at a time in process, and
    each client's p50 over `texts` against that server: in process, sync stub, grpc.aio and HTTP."""
    run = oc.in_process()
    grpc_port, http_port = free_ports(2)
    flags = ["--repository", "models", "--graph", "optimized", "--port", str(grpc_port), "--http-port", str(http_port)]
    address = f"127.0.0.1:{grpc_port}"
    measure = {
        "inproc": lambda: oc.p50_ms(run, texts),
        "sync": lambda: sync_p50(address, texts),
        "aio": lambda: asyncio.run(aio_p50(address, texts)),
        "http": lambda: asyncio.run(http_p50(http_port, texts)),
    }
    return flags, run, measure


def main(rounds: int, n: int) -> None:
    texts = oc.SHORT_TEXTS[:n]
    flags, run, measure = setup(texts)
    with ServerProcess(flags, Path("/tmp/clients-server.log")) as server:
        server.wait_serving()
        oc.p50_ms(run, texts[:20])
        rows = []
        for r in range(rounds):
            order = list(measure)[r % 4 :] + list(measure)[: r % 4]
            res = {what: measure[what]() for what in order}
            rows.append(res)
            gaps = " ".join(f"{k}-in {res[k] - res['inproc']:+.2f}" for k in ("sync", "aio", "http"))
            print(f"round {r}: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()) + f" | {gaps}", flush=True)
        for k in ("sync", "aio", "http"):
            print(k, "median gap", f"{statistics.median(x[k] - x['inproc'] for x in rows):+.2f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
