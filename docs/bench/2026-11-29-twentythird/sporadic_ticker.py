"""sporadic.py's queries alone at random times, served over HTTP and in process, with and without ticker.py
running beside them, alternated. Run from the repository root:
  python docs/bench/2026-11-29-twentythird/sporadic_ticker.py ROUNDS SECONDS STEP WORK
"""

import asyncio
import os
import signal
import statistics
import subprocess
import sys

sys.path.insert(0, "docs/bench")
sys.path.insert(0, "docs/bench/2026-11-29-twentythird")
from pathlib import Path

import one_client as oc
import sporadic as sp

from mhaserve.loadtest.bench import beside
from mhaserve.testing.loopback import free_ports
from mhaserve.testing.process import ServerProcess

rounds, secs = int(sys.argv[1]), float(sys.argv[2])
step, work = sys.argv[3], sys.argv[4]
texts = oc.SHORT_TEXTS
run = oc.in_process()
gp, hp = free_ports(2)
flags = ["--repository", "models", "--graph", "optimized", "--port", str(gp), "--http-port", str(hp)]
url = f"http://127.0.0.1:{hp}"
res = {}
with ServerProcess(flags, Path("/tmp/ticker-server.log")) as server:
    server.wait_serving()
    for r in range(rounds):
        for tick in [False, True] if r % 2 == 0 else [True, False]:
            p = (
                subprocess.Popen(
                    [sys.executable, "docs/bench/2026-11-29-twentythird/ticker.py", step, work], start_new_session=True
                )
                if tick
                else None
            )
            s = asyncio.run(beside.measure(url, texts, 0, secs, 10, r))["latency_ms"]["p50"]
            i = statistics.median(sp.in_process_sporadic(run, texts, secs, 10, r))
            if p:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            res.setdefault(tick, []).append((s, i))
            print(f"round {r} ticker {tick}: served sporadic p50 {s:.2f}, in process {i:.2f}", flush=True)
for t, xs in res.items():
    print(
        f"ticker {t}: served {statistics.median(x[0] for x in xs):.2f}, "
        f"in process {statistics.median(x[1] for x in xs):.2f}"
    )
