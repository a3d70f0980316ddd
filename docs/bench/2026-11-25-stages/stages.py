"""Where a lone request's time goes: one synchronous gRPC client sends the short texts one at a time, and
the server's own histograms (means over each block) split its time into tokenising, queue, model and the
rest; ONNX Runtime in process runs the same texts one at a time on the same graph, alternated with the
server in rounds, timing the model call alone and with the tokeniser."""

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
from mhaserve.testing.loopback import free_port
from mhaserve.testing.metrics import scrape
from mhaserve.testing.process import ServerProcess

TEXTS = [line for line in Path("loadtest/texts/short.txt").read_text().splitlines() if line.strip()][:300]
EXTRA = sys.argv[2:]  # more `mhaserve serve` flags
metrics_port = free_port()
proc = ServerProcess(
    ["--repository", "models", "--port", "0", "--metrics-port", str(metrics_port), "--device", "cpu", *EXTRA],
    Path("stages-server.log"),
)
addr = proc.wait_serving()
HISTOGRAMS = {
    "request": "mhaserve_request_duration_seconds",
    "tokenize": "mhaserve_tokenize_duration_seconds",
    "queue": "mhaserve_queue_wait_seconds",
    "model": "mhaserve_inference_duration_seconds",
}


def sums() -> dict[str, tuple[float, float]]:
    s = scrape(metrics_port)
    out = {}
    for key, name in HISTOGRAMS.items():
        labels = {"method": "encoder.v1.EncoderService/Encode"} if key == "request" else {}
        out[key] = (s.get(name + "_sum", **labels), s.get(name + "_count", **labels))
    return out


def server_block(stub) -> dict[str, float]:
    before = sums()
    lat = []
    for t in TEXTS:
        t0 = time.perf_counter()
        stub.Encode(pb.EncodeRequest(texts=[t], truncate=True))
        lat.append(time.perf_counter() - t0)
    after = sums()
    means = {k: 1000 * (after[k][0] - before[k][0]) / max(1.0, after[k][1] - before[k][1]) for k in HISTOGRAMS}
    return {"client p50": 1000 * statistics.median(lat), "client mean": 1000 * statistics.mean(lat)} | {
        f"server {k} mean": v for k, v in means.items()
    }


entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2")
engine = onnx_engine("cpu", None)(entry)
tok = Tokenizer.from_file(str(entry.tokenizer_path))
tok.no_padding()
tok.enable_truncation(256)


def inproc_block() -> dict[str, float]:
    total, run = [], []
    for t in TEXTS:
        t0 = time.perf_counter()
        ids = np.asarray([tok.encode(t).ids], dtype=np.int64)
        t1 = time.perf_counter()
        engine.run(ids, np.ones_like(ids))
        t2 = time.perf_counter()
        total.append(t2 - t0)
        run.append(t2 - t1)
        time.sleep(0.001)  # a client's pause between requests
    return {
        "in-process p50": 1000 * statistics.median(total),
        "in-process mean": 1000 * statistics.mean(total),
        "in-process model mean": 1000 * statistics.mean(run),
    }


rounds: list[dict[str, float]] = []
try:
    with grpc.insecure_channel(addr) as channel:
        stub = pbg.EncoderServiceStub(channel)
        for _ in range(20):
            stub.Encode(pb.EncodeRequest(texts=["warm up"], truncate=True))
        for r in range(int(sys.argv[1])):
            row: dict[str, float] = {}
            for kind in ("server", "inproc") if r % 2 == 0 else ("inproc", "server"):
                row |= server_block(stub) if kind == "server" else inproc_block()
            rounds.append(row)
            print(f"round {r}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
finally:
    proc.signal()
    proc.wait()
print("medians of rounds (ms):")
for k in rounds[0]:
    print(f"  {k}: {statistics.median(r[k] for r in rounds):.2f}")
