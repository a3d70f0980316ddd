"""py-spy on the server's event loop under 32 closed-loop clients (short texts), the lean gRPC front driven
by the bench's h2 client, or HTTP: where the loop's CPU a request goes now that the front is small.

The fourteenth session's profile32.py with this tree's defaults (`--graph auto`) and the front chosen.
Run from the repository root:
    python docs/bench/2026-11-29-twentyeighth/profile32.py PY_SPY SECONDS PROTOCOL OUT [--native]
"""

import asyncio
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
from regress import start, workloads_of  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402


def main(py_spy: str, seconds: float, protocol: str, out: str, native: bool) -> None:
    workloads = workloads_of(["short"])
    flags = ("--graph", "auto", "--grpc-front", "lean")
    server, address, url = start(sys.executable, Path("/tmp/profile32-serve.log"), flags)
    try:
        link = transport(protocol, address, url, workloads["short"], grpc_client="h2")
        # warm up before py-spy attaches, so the profile holds the steady state only
        asyncio.run(_closed_loop([(link, len(workloads["short"].ids))], 32, 5.0, 15.0, [server.pid]))
        spy = subprocess.Popen([py_spy, "record", "-p", str(server.pid), "-d", str(int(seconds)), "-r", "200",
                                "-f", "raw", "-o", out, "--threads", "--nonblocking",
                                *(["--native"] if native else [])])  # fmt: skip
        raw = asyncio.run(_closed_loop([(link, len(workloads["short"].ids))], 32, seconds, 2.0, [server.pid]))
        group, elapsed = raw["groups"][0], raw["window"][1] - raw["window"][0]
        n = group["completed"]
        loop = (raw["server_threads_cpu_s"] or {}).get("event loop", float("nan"))
        print(f"{protocol}: {n / elapsed:.1f} seq/s over {elapsed:.1f} s; server {raw['server_cpu_s'] / n * 1e6:.0f} "
              f"us a request, its loop {loop / n * 1e6:.0f} us, client {raw['client_cpu_s'] / n * 1e6:.0f} us",
              flush=True)  # fmt: skip
        spy.wait(60)
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], "--native" in sys.argv[5:])
