"""A/B of the code itself: POST /v1/embeddings through FastAPI (a4cf579) against the call middleware's fast
route (ed1bc79), alternated in rounds. Each round checks out each version's service/, cli/ and runtime/
(the editable install serves them), starts the server (defaults, the fused graph), and over HTTP (one keep-alive
connection per client, raw HTTP/1.1 as the bench's client) measures one client's p50 over 300 short
texts, then 32 clients for --seconds; and the CPU per request of the server's event loop (its main
thread) in each, and of the whole server at 32 clients. Those three folders of
the working tree are restored at the end. Run from the repository root: python ab_fast.py ROUNDS SECONDS"""

import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: one_client.py
from one_client import SHORT_TEXTS, http_latencies, raw

from mhaserve.loadtest.bench.transports import HttpConnection
from mhaserve.testing.loopback import free_port
from mhaserve.testing.process import ServerProcess

TEXTS = SHORT_TEXTS
VERSIONS = {"fastapi": "a4cf579", "fast": "ed1bc79"}
# The server's code as it was at each version: service/ with the command line and the runtime of its day
# (today's cli/ sets options, such as --processes, that the service/ of a4cf579 does not have).
CODE = ["service", "cli", "runtime"]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """The process's CPU seconds, or one of its threads' (the main thread, tid == pid, runs the event loop)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def one_client(port: int) -> list[float]:
    return await http_latencies(port, TEXTS[:300])


async def clients_32(port: int, seconds: float) -> int:
    stop = time.perf_counter() + seconds
    requests = [raw(t, port) for t in TEXTS]

    async def user(i: int) -> int:
        conn, n, k = HttpConnection("127.0.0.1", port), 0, i
        while time.perf_counter() < stop:
            status, _ = await conn.request(requests[k % len(requests)])
            assert status == 200
            n, k = n + 1, k + 32
        conn.close()
        return n

    return sum(await asyncio.gather(*(user(i) for i in range(32))))


results: dict[str, dict[str, list[float]]] = {
    v: {"p50 ms": [], "loop ms/req, 1": [], "seq/s": [], "loop ms/req, 32": [], "cpu ms/req, 32": []} for v in VERSIONS
}
try:
    for r in range(int(sys.argv[1])):
        for name in list(VERSIONS) if r % 2 == 0 else list(reversed(VERSIONS)):
            subprocess.run(["git", "checkout", VERSIONS[name], "--", *CODE], check=True)
            port = free_port()
            proc = ServerProcess(
                ["--repository", "models", "--port", "0", "--metrics-port", "0", "--http-port", str(port)],
                Path(f"/tmp/ab-fast-{name}.log"),
            )
            proc.wait_serving()
            asyncio.run(clients_32(port, 1.0))  # warm-up
            l0 = cpu_seconds(proc.pid, proc.pid)
            lat = asyncio.run(one_client(port))
            l1, c1 = cpu_seconds(proc.pid, proc.pid), cpu_seconds(proc.pid)
            t0 = time.perf_counter()
            n = asyncio.run(clients_32(port, float(sys.argv[2])))
            elapsed = time.perf_counter() - t0
            l2, c2 = cpu_seconds(proc.pid, proc.pid), cpu_seconds(proc.pid)
            proc.signal()
            proc.wait()
            row = results[name]
            row["p50 ms"].append(1000 * statistics.median(lat))
            row["loop ms/req, 1"].append(1000 * (l1 - l0) / len(lat))
            row["seq/s"].append(n / elapsed)
            row["loop ms/req, 32"].append(1000 * (l2 - l1) / n)
            row["cpu ms/req, 32"].append(1000 * (c2 - c1) / n)
            print(f"round {r} {name}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in row.items()), flush=True)
finally:
    subprocess.run(["git", "checkout", "HEAD", "--", *CODE], check=True)
for name, row in results.items():
    print(name, "medians: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in row.items()))
