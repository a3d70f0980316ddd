"""A lone request with one server process and with two that share the cores (and two pinned ones):
alternated rounds, each starting every configuration afresh and sending the first 300 short texts one at a
time from one client, over gRPC (a synchronous stub) and over HTTP (one keep-alive connection, the OpenAI
route), then ONNX Runtime in this process on the same texts one at a time (the fused graph, all cores,
tokeniser counted). Prints each p50 and its gap to the in-process one of the same round.
Run from the repository root: python docs/bench/2026-11-26-share/lone.py ROUNDS [CONFIG ...] (default: all three)"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: one_client.py
from one_client import SHORT_TEXTS, in_process, p50_ms, served_p50s

from mhaserve.testing.loopback import free_port, wait_until
from mhaserve.testing.process import ServerProcess

TEXTS = SHORT_TEXTS[:300]
CONFIGS = {
    "1 process": [],
    "2 sharing": ["--processes", "2"],
    "2 pinned": ["--processes", "2", "--intra-op-threads", "1"],
}
one_text = in_process()


def served(flags: list[str]) -> tuple[float, float]:
    port = free_port()
    server = ServerProcess(
        ["--repository", "models", "--graph", "optimized", "--port", "0", "--metrics-port", "0",
         "--http-port", str(port), *flags],
        Path("/tmp/lone-serve.log"),
    )  # fmt: skip
    with server:
        address = server.wait_serving()
        if flags:
            wait_until(lambda: "all 2 processes are serving" in server.log, "both processes to serve", 180)
        p50s = served_p50s(address, port, TEXTS)
        server.signal()
        server.wait()
    return p50s


if sys.argv[2:]:
    CONFIGS = {name: CONFIGS[name] for name in sys.argv[2:]}
gaps: dict[str, dict[str, list[float]]] = {name: {"grpc": [], "http": []} for name in CONFIGS}
for r in range(int(sys.argv[1])):
    names = list(CONFIGS)
    names = names[r % len(names) :] + names[: r % len(names)]
    measured = {name: served(CONFIGS[name]) for name in names}
    ref = p50_ms(one_text, TEXTS)
    line = [f"round {r}: in process {ref:.2f} ms"]
    for name, (g, h) in measured.items():
        gaps[name]["grpc"].append(g - ref)
        gaps[name]["http"].append(h - ref)
        line.append(f"{name} gRPC {g:.2f} ({g - ref:+.2f}), HTTP {h:.2f} ({h - ref:+.2f})")
    print("; ".join(line), flush=True)
print("medians of the gaps to ONNX Runtime in process, one text at a time (ms):")
for name, by in gaps.items():
    print(f"  {name}: gRPC {statistics.median(by['grpc']):+.2f}, HTTP {statistics.median(by['http']):+.2f}")
