"""Requests of several long texts queued together: when each is answered, how many a deadline or a drain's
grace period lets through. Against a server already started (`mhaserve serve`, the default model):

    python lockstep.py burst GRPC_PORT                 # 8 requests of 16 texts at once: no deadline, then 8 s
    python lockstep.py loop GRPC_PORT                  # 16 closed-loop clients of 4 texts, 2 s deadline, 20 s
    python lockstep.py drain GRPC_PORT SERVER_PID      # 51 requests of 4 texts, SIGTERM 0.5 s later

(`drain` wants the server started with `--grace-period`; it stops it.) Each text is 300 words, truncated to
the model's 256 tokens: one text a batch under the CPU's budget.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import signal
import sys
import threading
import time

import grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pbg

LONG = " ".join(f"word{i}" for i in range(300))


def call(stub: pbg.EncoderServiceStub, tag: str, k: int, timeout: float) -> float | str:
    """One request of `k` long texts: the seconds it took, or its status's name."""
    t0 = time.monotonic()
    try:
        stub.Encode(pb.EncodeRequest(texts=[f"{LONG} {tag} {j}" for j in range(k)], truncate=True), timeout=timeout)
    except grpc.RpcError as e:
        return str(e.code().name)
    return round(time.monotonic() - t0, 1)


def counted(outcomes: list[float | str]) -> dict[str, int]:
    return dict(collections.Counter("OK" if isinstance(r, float) else r for r in outcomes))


def main() -> None:
    what, port = sys.argv[1], int(sys.argv[2])
    stub = pbg.EncoderServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    stub.Encode(pb.EncodeRequest(texts=["warm"]))
    if what == "burst":
        for timeout in (120.0, 8.0):
            with cf.ThreadPoolExecutor(8) as ex:
                out = list(ex.map(lambda i, t=timeout: call(stub, f"{t} {i}", 16, t), range(8)))
            print(
                f"deadline {timeout:g} s: answered after", sorted(r for r in out if isinstance(r, float)), counted(out)
            )
    elif what == "loop":
        outcomes: list[float | str] = []
        stop = time.monotonic() + 20

        def client(c: int) -> None:
            i = 0
            while time.monotonic() < stop:
                i += 1
                outcomes.append(call(stub, f"{c}-{i}", 4, 2.0))

        threads = [threading.Thread(target=client, args=(c,)) for c in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(counted(outcomes))
    else:
        pid = int(sys.argv[3])
        with cf.ThreadPoolExecutor(51) as ex:
            futures = [ex.submit(call, stub, str(i), 4, 60.0) for i in range(51)]
            time.sleep(0.5)
            os.kill(pid, signal.SIGTERM)
            print(counted([f.result() for f in futures]))


if __name__ == "__main__":
    main()
