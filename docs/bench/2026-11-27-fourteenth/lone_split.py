"""A lone request's time split by the server's own histograms: one closed-loop client for SECONDS over PROTOCOL
(the bench's transport and short texts), then the means from /metrics: the client's round trip, the server's
handler (request duration), tokenising, the queue wait, and the model's time per batch, beside ONNX Runtime one
text at a time in process on the same texts (tokenising included). Means, not p50s: the histograms keep sums.
Run from the repository root: python docs/bench/2026-11-27-fourteenth/lone_split.py SECONDS grpc|http ROUNDS
"""

import asyncio
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
from regress import start  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402
from mhaserve.loadtest.bench.workloads import build  # noqa: E402
from mhaserve.runtime.engine import OnnxEngine  # noqa: E402
from mhaserve.runtime.repository import ModelRepository  # noqa: E402
from mhaserve.runtime.tokenizer import load_for_serving  # noqa: E402

NAMES = ("mhaserve_request_duration_seconds", "mhaserve_tokenize_duration_seconds", "mhaserve_queue_wait_seconds",
         "mhaserve_inference_duration_seconds")  # fmt: skip


def sums(url: str) -> dict[str, tuple[float, float]]:
    body = urllib.request.urlopen(url).read().decode()
    out = {n: [0.0, 0.0] for n in NAMES}
    for line in body.splitlines():
        for n in NAMES:
            if line.startswith(n + "_sum"):
                out[n][0] += float(line.split()[-1])
            elif line.startswith(n + "_count"):
                out[n][1] += float(line.split()[-1])
    return {n: (s, c) for n, (s, c) in out.items()}


def main(seconds: float, protocol: str, rounds: int) -> None:
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    workloads = build(["short"], tokenizer, max_seq_len=entry.manifest.max_seq_len, fixed_tokens=128,
                      fixed_pool=64, mixed_pool=256, short_pool=2000)  # fmt: skip
    texts = workloads["short"].texts[:300]
    for r in range(rounds):
        server, address, url = start(sys.executable, Path("/tmp/lone-split-serve.log"))
        metrics = next(line.split("metrics on ")[1].strip() for line in Path("/tmp/lone-split-serve.log").read_text()
                       .splitlines() if "metrics on " in line)  # fmt: skip
        try:
            link = transport(protocol, address, url, workloads["short"])
            before = sums(metrics)
            raw = asyncio.run(_closed_loop([(link, len(workloads["short"].ids))], 1, seconds, 5.0, [server.pid]))
            after = sums(metrics)
        finally:
            server.terminate()
            server.wait(60)
        lat = raw["groups"][0]["latencies"]
        mean = {n: (after[n][0] - before[n][0]) / max(1.0, after[n][1] - before[n][1]) * 1000 for n in NAMES}
        engine = OnnxEngine(entry.graph_path, max_seq_len=entry.manifest.max_seq_len,
                            vocab_size=entry.manifest.vocab_size, device="cpu")  # fmt: skip
        own = []
        for t in texts:
            t0 = time.perf_counter()
            ids = tokenizer.encode(t).ids
            engine.run(np.array([ids], dtype=np.int64), np.ones((1, len(ids)), dtype=np.int64))
            own.append((time.perf_counter() - t0) * 1000)
        del engine
        print(f"round {r} {protocol}: client mean {statistics.fmean(lat):.2f} p50 {statistics.median(lat):.2f} ms; "
              f"server handler {mean[NAMES[0]]:.2f}, tokenize {mean[NAMES[1]]:.3f}, queue wait {mean[NAMES[2]]:.3f}, "
              f"model a batch {mean[NAMES[3]]:.2f}; in process one at a time mean {statistics.fmean(own):.2f} "
              f"p50 {statistics.median(own):.2f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
