"""A lone request with one server process and with two that share the cores (and two pinned ones):
alternated rounds, each starting every configuration afresh and sending the first 300 short texts one at a
time from one client, over gRPC (a synchronous stub) and over HTTP (one keep-alive connection, the OpenAI
route), then ONNX Runtime in this process on the same texts one at a time (the fused graph, all cores,
tokeniser counted). Prints each p50 and its gap to the in-process one of the same round.
Run from the repository root: python docs/bench/2026-11-26-share/lone.py ROUNDS [CONFIG ...] (default: all three)"""

import http.client
import json
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
from mhaserve.testing.loopback import free_port, wait_until
from mhaserve.testing.process import ServerProcess

TEXTS = [line for line in Path("loadtest/texts/short.txt").read_text().splitlines() if line.strip()][:300]
CONFIGS = {
    "1 process": [],
    "2 sharing": ["--processes", "2"],
    "2 pinned": ["--processes", "2", "--intra-op-threads", "1"],
}

entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
engine = onnx_engine("cpu")(entry)
tok = Tokenizer.from_file(str(entry.tokenizer_path))
tok.no_padding()
tok.enable_truncation(256)


def p50_ms(call) -> float:
    lat = []
    for t in TEXTS:
        t0 = time.perf_counter()
        call(t)
        lat.append(time.perf_counter() - t0)
    return 1000 * statistics.median(lat)


def in_process(text: str) -> None:
    ids = np.asarray([tok.encode(text).ids], dtype=np.int64)
    engine.run(ids, np.ones_like(ids))


def served(flags: list[str]) -> tuple[float, float]:
    port = free_port()
    server = ServerProcess(
        ["--repository", "models", "--graph", "optimized", "--port", "0", "--metrics-port", "0",
         "--http-port", str(port), *flags],
        Path("/tmp/lone-serve.log"),
    )  # fmt: skip
    with server:
        address = server.wait_serving()
        if flags:
            wait_until(lambda: "all 2 processes are serving" in server.log, "both processes to serve", 180)
        with grpc.insecure_channel(address) as channel:
            stub = pbg.EncoderServiceStub(channel)
            for _ in range(20):
                stub.Encode(pb.EncodeRequest(texts=["warm up"], truncate=True))
            grpc_p50 = p50_ms(lambda t: stub.Encode(pb.EncodeRequest(texts=[t], truncate=True)))
        conn = http.client.HTTPConnection("127.0.0.1", port)

        def post(text: str) -> None:
            conn.request("POST", "/v1/embeddings", json.dumps({"input": text, "truncate": True}),
                         {"content-type": "application/json"})  # fmt: skip
            reply = conn.getresponse()
            reply.read()
            assert reply.status == 200

        for _ in range(20):
            post("warm up")
        http_p50 = p50_ms(post)
        conn.close()
        server.signal()
        server.wait()
    return grpc_p50, http_p50


if sys.argv[2:]:
    CONFIGS = {name: CONFIGS[name] for name in sys.argv[2:]}
gaps: dict[str, dict[str, list[float]]] = {name: {"grpc": [], "http": []} for name in CONFIGS}
for r in range(int(sys.argv[1])):
    names = list(CONFIGS)
    names = names[r % len(names) :] + names[: r % len(names)]
    measured = {name: served(CONFIGS[name]) for name in names}
    ref = p50_ms(in_process)
    line = [f"round {r}: in process {ref:.2f} ms"]
    for name, (g, h) in measured.items():
        gaps[name]["grpc"].append(g - ref)
        gaps[name]["http"].append(h - ref)
        line.append(f"{name} gRPC {g:.2f} ({g - ref:+.2f}), HTTP {h:.2f} ({h - ref:+.2f})")
    print("; ".join(line), flush=True)
print("medians of the gaps to ONNX Runtime in process, one text at a time (ms):")
for name, by in gaps.items():
    print(f"  {name}: gRPC {statistics.median(by['grpc']):+.2f}, HTTP {statistics.median(by['http']):+.2f}")
