"""A/B of the batcher's workers woken one at a time (new: wake_one.patch applied) against asyncio.Event (old), with
the scripted engine (4 ms asleep a batch): one client's p50 and the event loop's CPU a request, over gRPC and HTTP,
and 32 clients' calls a second and CPU a request; each round starts a server afresh from each version of
service/batching/batcher.py, in turns, and the working tree's file is put back at the end. From the repository root:
    git show HEAD:service/batching/batcher.py > /tmp/batcher.old.py
    cp /tmp/batcher.old.py /tmp/batcher.new.py
    patch /tmp/batcher.new.py docs/bench/2026-12-03-fiftyfirst/wake_one.patch
    python docs/bench/2026-12-03-fiftyfirst/ab_wake.py ROUNDS SECONDS /tmp/batcher.old.py /tmp/batcher.new.py
"""

import asyncio
import shutil
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH / "2026-11-29-twentyeighth"))
sys.path.insert(0, str(BENCH / "2026-11-26-regress"))
from profile_fake import start_fake  # noqa: E402
from regress import workloads_of  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402
from mhaserve.loadtest.bench.workloads import Workload  # noqa: E402

TARGET = Path("service/batching/batcher.py")
Point = tuple[float, float, float, float]  # p50 ms, event loop CPU us a request, server CPU us a request, calls/s


def measure(source: Path, name: str, seconds: float, workload: Workload) -> dict[tuple[str, int], Point]:
    shutil.copy(source, TARGET)
    server, port, http = start_fake([sys.executable], "0.004", [], Path(f"/tmp/ab-wake-{name}.log"))
    out = {}
    try:
        for protocol in ("grpc", "http"):
            for clients in (1, 32):
                link = transport(protocol, f"127.0.0.1:{port}", f"http://127.0.0.1:{http}", workload)
                raw = asyncio.run(_closed_loop([(link, len(workload.ids))], clients, seconds, 1.0, [server.pid]))
                group = raw["groups"][0]
                n = group["completed"]
                loop_cpu = (raw.get("server_threads_cpu_s") or {}).get("event loop", 0.0) / n * 1e6
                rate = n / (raw["window"][1] - raw["window"][0])
                p50 = statistics.median(group["latencies"])
                out[(protocol, clients)] = (p50, loop_cpu, raw["server_cpu_s"] / n * 1e6, rate)
    finally:
        server.terminate()
        server.wait(30)
    return out


def main(rounds: int, seconds: float, old: Path, new: Path) -> None:
    workload = workloads_of(["short"])["short"]
    keep = TARGET.read_bytes()
    versions = {"old": old, "new": new}
    rows: dict[str, list[dict[tuple[str, int], Point]]] = {name: [] for name in versions}
    try:
        for r in range(rounds):
            for name in ["old", "new"] if r % 2 == 0 else ["new", "old"]:
                got = measure(versions[name], name, seconds, workload)
                rows[name].append(got)
                print(r, name, {f"{p}{c}": (round(x[0], 3), round(x[1]), round(x[3], 1)) for (p, c), x in got.items()})
    finally:
        TARGET.write_bytes(keep)
    for key in rows["old"][0]:
        for i, what in ((0, "p50 ms"), (1, "loop CPU us/req"), (2, "server CPU us/req"), (3, "req/s")):
            before = statistics.median(x[key][i] for x in rows["old"])
            after = statistics.median(x[key][i] for x in rows["new"])
            ratios = [b[key][i] / a[key][i] for a, b in zip(rows["old"], rows["new"], strict=True)]
            print(f"{key[0]} {key[1]} clients {what}: old {before:.3f} new {after:.3f} "
                  f"new/old {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
