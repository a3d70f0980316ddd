"""The server's own time around the model on a lone HTTP request, at two commits, alternated in rounds.

Each round checks out each version's service/ (the editable install serves them) and starts
stamps_server.py: the scripted engine of the tests (5 ms asleep a batch, no model), with timestamps. One
client (one keep-alive connection, the OpenAI route, raw HTTP/1.1 as the bench's client) sends 200 short
texts to warm up, then 1,000, one at a time. Per request, the server's time is from its bytes in to the
engine's start, plus from the end of the engine's sleep to the body's send; medians per run, and the
client's p50. The working tree's service/ is restored at the end.
With MODEL=1 the server runs the model (the fused graph) instead: the server's time then leaves out
ONNX Runtime's run, whose own noise would hide a change of a few hundred microseconds.
With PROTOCOL=grpc the client calls `Encode` from a synchronous stub instead (the server's time is then
the servicer's, without grpc.aio's own and the interceptors').
Run from the repository root: [MODEL=1] [PROTOCOL=grpc] python trace_ab.py BEFORE AFTER ROUNDS
"""

import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: one_client.py
from one_client import SHORT_TEXTS, http_latencies

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.testing.loopback import free_port

HERE = Path(__file__).parent
TEXTS = SHORT_TEXTS


async def one_client(port: int, n: int) -> list[float]:
    return await http_latencies(port, (TEXTS * 10)[:n])


def one_grpc_client(port: int, n: int) -> list[float]:
    latencies = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pbg.EncoderServiceStub(channel)
        for text in (TEXTS * 10)[:n]:
            t0 = time.perf_counter()
            stub.Encode(pb.EncodeRequest(texts=[text], truncate=True))
            latencies.append(time.perf_counter() - t0)
    return latencies


def one_client_on(script: str, out: Path, log_path: Path) -> list[float]:
    """Start a stamping server (`script`, beside this file; the model with MODEL=1, else the scripted engine),
    warm it with 200 texts, time 1,000 from one client (over gRPC with PROTOCOL=grpc, else HTTP), stop it
    (its stamps go to `out`); the latencies."""
    port, grpc_port = free_port(), free_port()
    engine = ["--graph", "optimized"] if os.environ.get("MODEL") else ["--engine", "slow:0.005"]
    ports = ["--port", str(grpc_port), "--metrics-port", "0", "--http-port", str(port)]
    flags = [*engine, "--repository", "models", *ports]
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, str(HERE / script), *flags],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TRACE_OUT": str(out)},
        )  # fmt: skip
        while "serving all-minilm" not in log_path.read_text():
            assert server.poll() is None, log_path.read_text()
            time.sleep(0.2)
        time.sleep(1)
        if os.environ.get("PROTOCOL") == "grpc":
            one_grpc_client(grpc_port, 200)
            latencies = one_grpc_client(grpc_port, 1000)
        else:
            asyncio.run(one_client(port, 200))
            latencies = asyncio.run(one_client(port, 1000))
        server.send_signal(2)
        server.wait()
    return latencies


def measure(name: str) -> tuple[float, float, float, float]:
    out = Path(f"/tmp/trace-{name}.tsv")
    latencies = one_client_on("stamps_server.py", out, Path(f"/tmp/trace-{name}.log"))
    requests: list[dict[str, int]] = []
    for line in out.read_text().splitlines():
        name_, t = line.split("\t")
        if name_ == "A":
            requests.append({})
        if requests:
            requests[-1].setdefault(name_, int(t))
    whole = [r for r in requests[-1000:] if len(r) == 4]
    to_engine = [(r["F"] - r["A"]) / 1000 for r in whole]
    after_engine = [(r["J"] - r["G"]) / 1000 for r in whole]
    server_us = [a + b for a, b in zip(to_engine, after_engine, strict=True)]
    return (statistics.median(server_us), statistics.median(to_engine), statistics.median(after_engine),
            1000 * statistics.median(latencies))  # fmt: skip


def main() -> None:
    versions = {"before": sys.argv[1], "after": sys.argv[2]}
    results: dict[str, list[tuple[float, ...]]] = {v: [] for v in versions}
    try:
        for r in range(int(sys.argv[3])):
            for name in list(versions) if r % 2 == 0 else list(reversed(versions)):
                subprocess.run(["git", "checkout", versions[name], "--", "service"], check=True)
                s, a, b, c = measure(name)
                results[name].append((s, a, b, c))
                print(f"round {r} {name}: server us {s:.0f} (to the engine {a:.0f}, after it {b:.0f}); "
                      f"client p50 {c:.3f} ms", flush=True)  # fmt: skip
    finally:
        subprocess.run(["git", "checkout", "HEAD", "--", "service"], check=True)
    for name, rows in results.items():
        s, a, b, c = (statistics.median(col) for col in zip(*rows, strict=True))
        print(
            f"{name} ({versions[name]}) medians: server {s:.1f} us, to the engine {a:.1f}, after it {b:.1f}, "
            f"client {c:.2f} ms"
        )


if __name__ == "__main__":
    main()
