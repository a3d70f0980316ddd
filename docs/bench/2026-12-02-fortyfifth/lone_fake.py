"""One client over gRPC and HTTP against a server whose model sleeps 4 ms (a scripted engine: no CPU) and an
empty server idling 4 ms a call on the same gRPC front (loadtest/bench/empty.py), in rounds whose order turns:
what the server adds above the floor on each protocol with the cores free. Run from the repository root:
    python docs/bench/2026-12-02-fortyfifth/lone_fake.py ROUNDS SECONDS FRONT
"""

import asyncio
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH / "2026-11-29-twentyeighth"))
sys.path.insert(0, str(BENCH / "2026-11-26-regress"))
from profile_fake import start_fake  # noqa: E402
from regress import workloads_of  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.empty import EmptyServer  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402


def main(rounds: int, seconds: float, front: str) -> None:
    workload = workloads_of(["short"])["short"]
    server, port, http = start_fake([sys.executable], "0.004", ["--grpc-front", front], Path("/tmp/lone-fake.log"))
    empty = EmptyServer(384, 0.004, Path("/tmp/lone-fake-empty.log"), front)
    empty.start()
    assert empty.proc is not None
    targets = {
        "server grpc": ("grpc", f"127.0.0.1:{port}", f"http://127.0.0.1:{http}", server.pid),
        "server http": ("http", f"127.0.0.1:{port}", f"http://127.0.0.1:{http}", server.pid),
        "empty grpc": ("grpc", empty.address, empty.http_url, empty.proc.pid),
        "empty http": ("http", empty.address, empty.http_url, empty.proc.pid),
    }
    got: dict[str, list[tuple[float, float, dict[str, float]]]] = {k: [] for k in targets}
    try:
        for r in range(rounds):
            names = list(targets)
            for name in names[r % 4 :] + names[: r % 4]:
                protocol, address, url, pid = targets[name]
                link = transport(protocol, address, url, workload)
                raw = asyncio.run(_closed_loop([(link, len(workload.ids))], 1, seconds, 2.0, [pid]))
                group = raw["groups"][0]
                n = group["completed"]
                threads = {t: v / n * 1e3 for t, v in (raw.get("server_threads_cpu_s") or {}).items()}
                got[name].append((statistics.median(group["latencies"]), raw["server_cpu_s"] / n * 1e3, threads))
            print(r, {k: round(v[-1][0], 3) for k, v in got.items()}, flush=True)
    finally:
        server.terminate()
        server.wait(30)
        empty.stop()
    for name, runs in got.items():
        by_thread = {t: round(statistics.median(x[2].get(t, 0.0) for x in runs), 3) for t in runs[0][2]}
        p50, cpu = statistics.median(x[0] for x in runs), statistics.median(x[1] for x in runs)
        print(f"{name}: p50 {p50:.3f} ms, server CPU {cpu:.3f} ms/req,", by_thread)
    for p in ("grpc", "http"):
        above = statistics.median(a[0] - b[0] for a, b in zip(got[f"server {p}"], got[f"empty {p}"], strict=True))
        print(p, "server above empty:", round(above, 3), "ms")


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
