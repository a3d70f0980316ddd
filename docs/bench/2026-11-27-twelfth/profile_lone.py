"""The eleventh session's profile_loop.py at CLIENTS closed-loop clients (1: a lone request's path) instead
of 32: py-spy records the server's event loop while the clients send the short texts over gRPC or HTTP.
Run from the repository root:
  python docs/bench/2026-11-27-twelfth/profile_lone.py SECONDS grpc|http CLIENTS OUT.txt
"""

import asyncio
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-27-eighth"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-27-eleventh"))
from profile_loop import top  # noqa: E402
from trace_fixed import start, workload  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402


def main(seconds: float, protocol: str, clients: int, out: Path) -> None:
    work = workload("short")
    server, port, http = start("profile", [], None)
    try:
        link = transport(protocol, f"127.0.0.1:{port}", f"http://127.0.0.1:{http}", work)
        spy = subprocess.Popen(
            [str(Path(sys.executable).with_name("py-spy")), "record", "-p", str(server.pid), "-d", str(int(seconds)),
             "-r", "200", "-f", "raw", "-o", str(out), "--threads", "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        raw = asyncio.run(_closed_loop([(link, len(work.ids))], clients, seconds, 3 * seconds, [server.pid]))
        spy.wait(60)
    finally:
        server.terminate()
        server.wait(60)
    group, elapsed = raw["groups"][0], raw["window"][1] - raw["window"][0]
    n = group["completed"]
    per = {k: round(1000 * v / n, 3) for k, v in (raw["server_threads_cpu_s"] or {}).items()}
    print(
        f"{protocol}, {clients} clients: {n / elapsed:.1f} seq/s (py-spy attached); ms of CPU a request by thread {per}"
    )
    top(out)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
