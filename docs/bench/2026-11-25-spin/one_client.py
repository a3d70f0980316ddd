"""One client, the same server: the bench's grpc.aio client against a plain synchronous grpc stub, alternating
blocks of requests; and ONNX Runtime in process one text at a time (the served engine, tokenizer counted)
in between. p50 of each, per round."""

import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc
import numpy as np
from tokenizers import Tokenizer

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.runtime.repository import ModelRepository, onnx_engine
from mhaserve.testing.process import ServerProcess

TEXTS = [line for line in Path("loadtest/texts/short.txt").read_text().splitlines() if line.strip()][:300]
# The server as the reliability runs start it (this script, as run, started it with subprocess and polled
# its health itself: the same command line and wait).
proc = ServerProcess(
    ["--repository", "models", "--port", "0", "--metrics-port", "0", "--http-port", "0", "--device", "cpu"],
    Path("one-client-server.log"),
)
addr = proc.wait_serving()


def sync_block(stub):
    lat = []
    for t in TEXTS:
        t0 = time.perf_counter()
        stub.Encode(pb.EncodeRequest(texts=[t], truncate=True))
        lat.append(time.perf_counter() - t0)
    return 1000 * statistics.median(lat)


async def aio_block():
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pbg.EncoderServiceStub(ch)
        await stub.Encode(pb.EncodeRequest(texts=["warm"], truncate=True))
        lat = []
        for t in TEXTS:
            t0 = time.perf_counter()
            await stub.Encode(pb.EncodeRequest(texts=[t], truncate=True))
            lat.append(time.perf_counter() - t0)
        return 1000 * statistics.median(lat)


entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2")
eng = None


def inproc_block():
    global eng
    if eng is None:
        eng = onnx_engine("cpu", None)(entry)
    tok = Tokenizer.from_file("models/all-minilm-l6-v2/1/tokenizer.json")
    tok.no_padding()
    tok.enable_truncation(256)
    lat = []
    for t in TEXTS:
        t0 = time.perf_counter()
        ids = np.asarray([tok.encode(t).ids], dtype=np.int64)
        eng.run(ids, np.ones_like(ids))
        lat.append(time.perf_counter() - t0)
        time.sleep(0.001)
    return 1000 * statistics.median(lat)


res = {"sync": [], "aio": [], "inproc": []}
with grpc.insecure_channel(addr) as ch:
    stub = pbg.EncoderServiceStub(ch)
    stub.Encode(pb.EncodeRequest(texts=["warm"], truncate=True))
    for r in range(int(sys.argv[1])):
        for kind in ["sync", "aio", "inproc"] if r % 2 == 0 else ["inproc", "aio", "sync"]:
            v = sync_block(stub) if kind == "sync" else asyncio.run(aio_block()) if kind == "aio" else inproc_block()
            res[kind].append(v)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in res.items()), flush=True)
proc.signal()
proc.wait()
for k, v in res.items():
    print(f"{k}: median {statistics.median(v):.2f} ms  {[round(x, 2) for x in v]}")
