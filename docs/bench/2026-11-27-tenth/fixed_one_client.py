"""One client sending 128-token inputs (token ids) to a fresh server with its defaults: the client's p50,
the server's own model time a batch (the mean of `mhaserve_inference_duration_seconds` over the same
requests), and ONNX Runtime in this process one input at a time (the fused graph, all cores), in rounds.
The client's p50 less the server's model time is what the server adds around a lone long input.
Run from the repository root: python docs/bench/2026-11-27-tenth/fixed_one_client.py ROUNDS [SERVER FLAG ...]
"""

import sys
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: one_client.py
from one_client import p50_ms

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.runtime.repository import ModelRepository, onnx_engine
from mhaserve.testing.loopback import free_port
from mhaserve.testing.metrics import scrape
from mhaserve.testing.process import ServerProcess

rng = np.random.default_rng(0)
INPUTS = [np.concatenate([[101], rng.integers(2000, 20000, 126), [102]]) for _ in range(200)]


def histogram(port: int, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram over all its labels, from the server's /metrics."""
    samples = scrape(port)
    return samples.get(f"{name}_sum"), samples.get(f"{name}_count")


def main(rounds: int, flags: list[str]) -> None:
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    engine = onnx_engine("cpu")(entry)
    for r in range(rounds):
        metrics_port = free_port()
        flags_ = ["--repository", "models", "--graph", "optimized", "--port", "0", "--metrics-port", str(metrics_port)]
        server = ServerProcess([*flags_, *flags], Path("/tmp/fixed-one-client.log"))
        with server:
            address = server.wait_serving()
            with grpc.insecure_channel(address) as channel:
                stub = pbg.EncoderServiceStub(channel)

                def call(ids: np.ndarray, stub: pbg.EncoderServiceStub = stub) -> None:
                    stub.Encode(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=ids.tolist())]))

                for ids in INPUTS[:20]:
                    call(ids)
                s0, c0 = histogram(metrics_port, "mhaserve_inference_duration_seconds")
                served = p50_ms(call, INPUTS)
                s1, c1 = histogram(metrics_port, "mhaserve_inference_duration_seconds")
            server.signal()
            server.wait()
        alone = p50_ms(lambda ids: engine.run(ids[None, :], np.ones((1, len(ids)), np.int64)), INPUTS)
        model = 1000 * (s1 - s0) / (c1 - c0)
        print(f"round {r}: served p50 {served:.2f} ms, the server's model time a batch {model:.2f} ms "
              f"(mean of {c1 - c0:.0f}), around it {served - model:+.2f} ms; in process p50 {alone:.2f} ms",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
