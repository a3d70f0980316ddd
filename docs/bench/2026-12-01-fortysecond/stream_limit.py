"""A client on Rust's h2 (hyper's and tonic's HTTP/2) that keeps N calls open on one connection to a running
server, 3,000 calls in all: how many the server answered and how many it refused (REFUSED_STREAM, reset 7).

    .venv/bin/python docs/bench/2026-12-01-fortysecond/stream_limit.py PORT N [CALLS]

Uses tests/service/rust_h2/build/client (`make rust-h2-client`)."""

import json
import subprocess
import sys
import time

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb

port, open_at_once = sys.argv[1], int(sys.argv[2])
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 3000
request = pb.EncodeRequest(texts=["hello world, a short query"]).SerializeToString()
encode = {"path": "/encoder.v1.EncoderService/Encode", "messages": [request.hex()]}
spec = {
    "address": f"127.0.0.1:{port}",
    # One call first, so that the server's SETTINGS (its limit of streams) have arrived before the rest.
    "rounds": [[encode], [dict(encode, copies=calls, concurrency=open_at_once)]],
}
start = time.perf_counter()
proc = subprocess.run(["tests/service/rust_h2/build/client"], input=json.dumps(spec), capture_output=True, text=True)
assert proc.returncode == 0, proc.stderr
answers = json.loads(proc.stdout)["rounds"][1][0]
codes: dict[str, int] = {}
for a in answers:
    key = f"reset {a['reset']}" if "reset" in a else "grpc-status " + (a["trailers"] or a["headers"])["grpc-status"]
    codes[key] = codes.get(key, 0) + 1
print(f"port {port}: {open_at_once} open at once, {calls} calls: {codes} in {time.perf_counter() - start:.1f} s")
