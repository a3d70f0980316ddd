"""py-spy on the event loop of a server whose model is a scripted engine (no CPU: each batch sleeps
SLOW seconds), under 32 closed-loop clients on the short texts: the loop's own work a request, measured
with the cores free, so that py-spy's wall-clock samples are its CPU (under the real model the loop is
preempted, and the frames it is preempted in read larger than they cost).
Run from the repository root:
    python docs/bench/2026-11-29-twentyeighth/profile_fake.py PY_SPY SECONDS PROTOCOL SLOW OUT [FLAGS...]
"""

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
from regress import workloads_of  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402
from mhaserve.testing.loopback import free_ports  # noqa: E402


def start_fake(python: list[str], slow: str, flags: list[str], log: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    """`python -m mhaserve.testing.fake_server` (after `python`, the interpreter and its own options) on this
    repository's models, its engine sleeping `slow` seconds a batch; returns it, its gRPC and HTTP ports, once
    it serves (it is terminated if it does not)."""
    port, metrics, http = free_ports(3)
    cmd = [*python, "-m", "mhaserve.testing.fake_server", "--engine", f"slow:{slow}", "--repository", "models",
           "--port", str(port), "--metrics-port", str(metrics), "--http-port", str(http), *flags]  # fmt: skip
    with log.open("w") as f:
        server = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while not re.search(r"serving all-minilm\S* version \d+ .*after", log.read_text()):
        if server.poll() is not None or time.time() > deadline:
            server.kill()
            raise RuntimeError(log.read_text())
        time.sleep(0.2)
    return server, port, http


def main(py_spy: str, seconds: float, protocol: str, slow: str, out: str, flags: list[str]) -> None:
    workloads = workloads_of(["short"])
    server, port, http = start_fake([sys.executable], slow, flags, Path("/tmp/profile-fake-serve.log"))
    try:
        link = transport(protocol, f"127.0.0.1:{port}", f"http://127.0.0.1:{http}", workloads["short"],
                         grpc_client="h2")  # fmt: skip
        load = [(link, len(workloads["short"].ids))]
        asyncio.run(_closed_loop(load, 32, 5.0, 15.0, [server.pid]))
        spy = subprocess.Popen([py_spy, "record", "-p", str(server.pid), "-d", str(int(seconds)), "-r", "500",
                                "-f", "raw", "-o", out, "--threads", "--nonblocking"])  # fmt: skip
        raw = asyncio.run(_closed_loop(load, 32, seconds, 2.0, [server.pid]))
        group, elapsed = raw["groups"][0], raw["window"][1] - raw["window"][0]
        n = group["completed"]
        threads = raw["server_threads_cpu_s"] or {}
        print(f"{protocol}: {n / elapsed:.1f} seq/s; server {raw['server_cpu_s'] / n * 1e6:.0f} us a request, "
              + ", ".join(f"{k} {v / n * 1e6:.0f}" for k, v in threads.items())
              + f"; client {raw['client_cpu_s'] / n * 1e6:.0f} us", flush=True)  # fmt: skip
        spy.wait(60)
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:])
