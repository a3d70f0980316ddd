"""A lone call over tei.v1 against encoder.v1's: the same text, one call at a time, 6 rounds of 100 calls each
whose order turns, against `mhaserve serve --repository models` (the default model, the lean front).

    .venv/bin/python docs/bench/2026-12-03-fiftyfifth/tei_lone.py
"""

from __future__ import annotations

import statistics
import subprocess
import time

import grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as epb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as epb_grpc
from mhaserve.proto.tei.v1 import tei_pb2 as tpb
from mhaserve.proto.tei.v1 import tei_pb2_grpc as tpb_grpc
from mhaserve.testing.loopback import free_port

TEXT = "how do I reset my password on the new site"
ROUNDS, CALLS = 6, 100


def main() -> None:
    port = free_port()
    command = [".venv/bin/mhaserve", "serve", "--repository", "models", "--port", str(port)]
    server = subprocess.Popen([*command, "--http-port", "0", "--metrics-port", "0"], stderr=subprocess.DEVNULL)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=120)
        encoder, tei = epb_grpc.EncoderServiceStub(channel), tpb_grpc.EmbedStub(channel)
        calls = {
            "encoder.v1 Encode": lambda: encoder.Encode(epb.EncodeRequest(texts=[TEXT]), timeout=5),
            "tei.v1 Embed": lambda: tei.Embed(tpb.EmbedRequest(inputs=TEXT), timeout=5),
        }
        while True:  # SERVING once the model is warm
            try:
                calls["encoder.v1 Encode"]()
                break
            except grpc.RpcError:
                time.sleep(0.5)
        for call in calls.values():
            for _ in range(CALLS):
                call()
        times: dict[str, list[float]] = {name: [] for name in calls}
        for round_ in range(ROUNDS):
            for name in list(calls) if round_ % 2 == 0 else list(calls)[::-1]:
                for _ in range(CALLS):
                    start = time.perf_counter()
                    calls[name]()
                    times[name].append((time.perf_counter() - start) * 1000)
                    time.sleep(0.002)
        for name, ms in times.items():
            p90 = statistics.quantiles(ms, n=10)[8]
            print(f"{name}: p50 {statistics.median(ms):.2f} ms, p90 {p90:.2f} ms over {len(ms)} calls")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
