"""What the dated folders' A/B scripts measure the same way, in one place: a lone request.

- `in_process()`: ONNX Runtime in this process on one text at a time (the fused graph or `graph`, all cores,
  tokeniser counted), the reference of issue 18's one-client target;
- `latencies(call, texts, pause)`: the seconds of each `call(text)`, one at a time, idle `pause` s after
  each; `p50_ms(call, texts)`: their median without pauses, in ms;
- `served_p50s(address, port, texts)`: one client's p50 against a running server, over gRPC (a synchronous
  stub) and over HTTP (`http.client`, one keep-alive connection, the OpenAI route), each after 20 warm-ups;
- `raw(text, port)` and `http_latencies(port, texts)`: the same HTTP request as raw bytes, and one
  client's latencies on one keep-alive connection, as the bench's own client sends them (with `pause`,
  idle that long after each).

The scripts put this folder on `sys.path` to import it; run them from the repository root.
"""

import asyncio
import http.client
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import numpy as np
import orjson
from tokenizers import Tokenizer

from mhaserve.loadtest.bench.transports import HttpConnection
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.runtime.repository import ModelRepository, onnx_engine

SHORT_TEXTS = [line for line in Path("loadtest/texts/short.txt").read_text().splitlines() if line.strip()]


def latencies(call: Callable[[str], object], texts: Sequence[str], pause: float = 0.0) -> list[float]:
    """Seconds each `call(text)` took, one at a time; with `pause`, that many seconds idle after each."""
    out = []
    for t in texts:
        t0 = time.perf_counter()
        call(t)
        out.append(time.perf_counter() - t0)
        if pause:
            time.sleep(pause)
    return out


def p50_ms(call: Callable[[str], object], texts: Sequence[str]) -> float:
    return 1000 * statistics.median(latencies(call, texts))


def in_process(graph: str = "optimized", overlap_threads: int | None = None) -> Callable[[str], None]:
    """One text through the tokeniser and ONNX Runtime, as the server would run it alone (`overlap_threads`:
    with the overlap session the server builds beside the main one with two inference workers)."""
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph=graph)
    engine = onnx_engine("cpu", None, overlap_threads)(entry)
    tok = Tokenizer.from_file(str(entry.tokenizer_path))
    tok.no_padding()
    tok.enable_truncation(256)

    def run(text: str) -> None:
        ids = np.asarray([tok.encode(text).ids], dtype=np.int64)
        engine.run(ids, np.ones_like(ids))

    return run


def served_p50s(address: str, port: int, texts: Sequence[str]) -> tuple[float, float]:
    """(gRPC p50, HTTP p50) in ms of one client against the server at `address` (gRPC) and `port` (HTTP)."""
    with grpc.insecure_channel(address) as channel:
        stub = pbg.EncoderServiceStub(channel)
        for _ in range(20):
            stub.Encode(pb.EncodeRequest(texts=["warm up"], truncate=True))
        grpc_p50 = p50_ms(lambda t: stub.Encode(pb.EncodeRequest(texts=[t], truncate=True)), texts)
    conn = http.client.HTTPConnection("127.0.0.1", port)

    def post(text: str) -> None:
        conn.request("POST", "/v1/embeddings", json.dumps({"input": text, "truncate": True}),
                     {"content-type": "application/json"})  # fmt: skip
        reply = conn.getresponse()
        reply.read()
        assert reply.status == 200

    for _ in range(20):
        post("warm up")
    http_p50 = p50_ms(post, texts)
    conn.close()
    return grpc_p50, http_p50


def raw(text: str, port: int) -> bytes:
    body = orjson.dumps({"input": text, "encoding_format": "float", "truncate": True})
    head = f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def http_latencies(port: int, texts: Sequence[str], pause: float = 0.0) -> list[float]:
    conn, out = HttpConnection("127.0.0.1", port), []
    for text in texts:
        t0 = time.perf_counter()
        status, _ = await conn.request(raw(text, port))
        out.append(time.perf_counter() - t0)
        assert status == 200
        if pause:
            await asyncio.sleep(pause)
    conn.close()
    return out
