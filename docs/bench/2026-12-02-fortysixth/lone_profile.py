"""Where the event loop's CPU goes on a lone client's requests, with the cores free: a server whose model is a
scripted engine (each batch sleeps 4 ms, no CPU), one closed-loop gRPC client (the bench's HTTP/2 one), the
server's CPU a request by thread, then py-spy on it (1,000 samples a second) and the loop thread's frames that
take the most samples, in microseconds a request. Run from the repository root:
    python docs/bench/2026-12-02-fortysixth/lone_profile.py PY_SPY SECONDS [FLAGS...]
"""

import asyncio
import subprocess
import sys
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH / "2026-11-29-twentyeighth"))
sys.path.insert(0, str(BENCH / "2026-11-26-regress"))
from profile_fake import start_fake  # noqa: E402
from regress import workloads_of  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402


def main(py_spy: str, seconds: float, flags: list[str]) -> None:
    workload = workloads_of(["short"])["short"]
    server, port, http = start_fake([sys.executable], "0.004", flags, Path("/tmp/lone-profile.log"))
    out = Path("/tmp/lone-profile.raw")
    try:
        link = transport("grpc", f"127.0.0.1:{port}", f"http://127.0.0.1:{http}", workload, grpc_client="h2")
        load = [(link, len(workload.ids))]
        raw = asyncio.run(_closed_loop(load, 1, 10.0, 3.0, [server.pid]))
        n = raw["groups"][0]["completed"]
        threads = raw["server_threads_cpu_s"] or {}
        print(f"{n / (raw['window'][1] - raw['window'][0]):.1f} requests/s; server {raw['server_cpu_s'] / n * 1e6:.0f} "
              "us of CPU a request: " + ", ".join(f"{k} {v / n * 1e6:.0f}" for k, v in threads.items()))  # fmt: skip
        spy = subprocess.Popen([py_spy, "record", "-p", str(server.pid), "-d", str(int(seconds)), "-r", "1000",
                                "-f", "raw", "-o", str(out), "--threads", "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        raw = asyncio.run(_closed_loop(load, 1, seconds, 0.5, [server.pid]))
        spy.wait(60)
        n = raw["groups"][0]["completed"]
    finally:
        server.terminate()
        server.wait(60)
    own: Counter[str] = Counter()
    for line in out.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        if "MainThread" in frames[0]:
            own[frames[-1]] += int(count)
    print(f"py-spy, the loop thread's own frames over {n} requests (us a request; select() is its wait):")
    for frame, count in own.most_common(12):
        print(f"  {count / n * 1e3:7.1f}  {frame}")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3:])
