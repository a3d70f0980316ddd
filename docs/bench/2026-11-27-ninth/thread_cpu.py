"""CPU of each of the server's threads, one by one (not by role), under 32 closed-loop clients of the short texts
for SECONDS, the server started with FLAGS. Names the threads that the bench report lumps together as `other`.
Run from the repository root:
  python docs/bench/2026-11-27-ninth/thread_cpu.py SECONDS grpc|http [FLAGS...]
"""

import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-27-eighth"))
from trace_fixed import start, workload  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.quiet import cpu_seconds_by_thread  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402


def main(seconds: float, protocol: str, flags: list[str]) -> None:
    work = workload("short")
    # With TRACE set, the server records its engine runs there (traced_serve.py of the eighth session).
    trace = os.environ.get("TRACE")
    server, port, http = start("thread-cpu", flags, Path(trace) if trace else None)
    link = transport(protocol, f"127.0.0.1:{port}", f"http://127.0.0.1:{http}", work)
    before = cpu_seconds_by_thread(server.pid) or {}
    raw = asyncio.run(_closed_loop([(link, len(work.ids))], 32, seconds, 3 * seconds, [server.pid]))
    after = cpu_seconds_by_thread(server.pid) or {}
    server.terminate()
    server.wait(60)
    done = raw["groups"][0]["completed"]
    print(f"{protocol} {' '.join(flags)}: {done} requests; CPU ms a request by thread:")
    for key in sorted(after, key=lambda k: before.get(k, 0.0) - after[k]):
        ms = 1000 * (after[key] - before.get(key, 0.0)) / done
        if ms >= 0.005:
            print(f"  {key[0]:>8} {key[1]:<16} {ms:6.3f}")


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2], [f for f in sys.argv[3:] if f])
