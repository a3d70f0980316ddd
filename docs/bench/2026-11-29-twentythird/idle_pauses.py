"""One client, one text at a time, idle PAUSE s after each: ONNX Runtime in process, then the served model from a
synchronous gRPC stub and over HTTP (the bench's client), each pause in turn. Run from the repository root:
  python docs/bench/2026-11-29-twentythird/idle_pauses.py TEXTS PAUSE [PAUSE ...]
"""

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, "docs/bench")
import grpc
import one_client as oc

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg
from mhaserve.testing.loopback import free_ports
from mhaserve.testing.process import ServerProcess

n = int(sys.argv[1])
pauses = [float(x) for x in sys.argv[2:]]
texts = oc.SHORT_TEXTS[:n]
run = oc.in_process()
gp, hp = free_ports(2)
flags = ["--repository", "models", "--graph", "optimized", "--port", str(gp), "--http-port", str(hp)]


def q(xs):
    xs = sorted(xs)
    return f"p50 {1e3 * xs[len(xs) // 2]:.2f} p90 {1e3 * xs[int(len(xs) * 0.9)]:.2f}"


with ServerProcess(flags, Path("/tmp/idle-server.log")) as server:
    server.wait_serving()
    ch = grpc.insecure_channel(f"127.0.0.1:{gp}")
    stub = pbg.EncoderServiceStub(ch)

    def g(t):
        return stub.Encode(pb.EncodeRequest(texts=[t], truncate=True))

    oc.latencies(g, texts[:20])
    oc.latencies(run, texts[:20])
    for p in pauses:
        a = oc.latencies(run, texts, p)
        b = oc.latencies(g, texts, p)
        c = asyncio.run(oc.http_latencies(hp, texts, p))
        print(f"pause {p * 1e3:5.0f} ms | in process {q(a)} | gRPC {q(b)} | HTTP {q(c)}", flush=True)
