"""32 clients on the fixed workload (128 token ids a request) for SECONDS against a server whose engine runs are
recorded (traced_serve.py), started with FLAGS; prints throughput, p50, p99 and the pattern of its batches, and
how the runs overlapped in time. WORKLOAD=short takes the short texts instead (added in the ninth session).
Run from the repository root:
  python docs/bench/2026-11-27-eighth/trace_fixed.py NAME SECONDS grpc|http [FLAGS...]
"""

import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
from regress import free_ports  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402
from mhaserve.loadtest.bench.workloads import Workload, build  # noqa: E402
from mhaserve.loadtest.stats import latency_summary  # noqa: E402
from mhaserve.runtime.repository import ModelRepository  # noqa: E402
from mhaserve.runtime.tokenizer import load_for_serving  # noqa: E402


def workload(which: str) -> Workload:
    """The bench's workload of that name (fixed, mixed or short) for the served model."""
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    return build([which], tokenizer, max_seq_len=entry.manifest.max_seq_len, fixed_tokens=128,
                 fixed_pool=64, mixed_pool=256, short_pool=2000)[which]  # fmt: skip


def start(name: str, flags: list[str], trace: Path | None) -> tuple[subprocess.Popen[bytes], int, int]:
    """`mhaserve serve` with FLAGS on free ports, its engine runs recorded in `trace` (None: a plain server),
    once it serves; (the process, its gRPC port, its HTTP port)."""
    port, metrics, http = free_ports(3)
    log = Path(f"/tmp/serve-{name}.log")
    entry_point = [str(Path(__file__).with_name("traced_serve.py"))] if trace else ["-m", "mhaserve.cli.main"]
    cmd = [sys.executable, *entry_point, "serve", "--repository", "models", "--graph", "optimized",
           "--port", str(port), "--metrics-port", str(metrics), "--http-port", str(http), *flags]  # fmt: skip
    env = dict(os.environ, TRACE=str(trace)) if trace else dict(os.environ)
    with log.open("w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    while not re.search(r"serving all-minilm\S* version \d+ .*after", log.read_text()):
        if server.poll() is not None:
            raise RuntimeError(log.read_text())
        time.sleep(0.2)
    time.sleep(1)
    return server, port, http


def main(name: str, seconds: float, protocol: str, flags: list[str]) -> None:
    work = workload(os.environ.get("WORKLOAD", "fixed"))
    trace = Path(f"/tmp/trace-{name}.json")
    server, port, http = start(name, flags, trace)
    link = transport(protocol, f"127.0.0.1:{port}", f"http://127.0.0.1:{http}", work)
    raw = asyncio.run(_closed_loop([(link, len(work.ids))], 32, seconds, 3 * seconds, [server.pid]))
    server.terminate()
    server.wait(60)
    group, elapsed = raw["groups"][0], raw["window"][1] - raw["window"][0]
    latency = latency_summary(group["latencies"])
    print(
        f"{name} {protocol}: seq/s {group['completed'] / elapsed:.1f} p50 {latency['p50']:.0f} p99 {latency['p99']:.0f}"
    )
    runs = [r for r in json.loads(trace.read_text()) if r[2] > 0]
    print("rows of the last 60 batches:", [r[2] for r in runs[-60:]])
    last = runs[-200:]
    overlapped = sum(r[4] for r in last) / len(last)
    print(
        f"of the last 200: on the overlap session {overlapped:.2f}, mean rows {statistics.mean(r[2] for r in last):.1f}"
    )
    print(concurrency(last))
    print("the last 30: start ms, duration ms, rows, overlapped")
    for r in runs[-30:]:
        print(f"  {1000 * (r[0] - runs[-30][0]):8.1f} {1000 * (r[1] - r[0]):7.1f} {r[2]:3d} {int(r[4])}")


def concurrency(runs: list[list[float]]) -> str:
    """How long 0, 1 and 2+ runs computed at once, from the first run's start to the last one's end (pass the
    runs under load: the warm-up's lie far before), and for how long a run on the main session (all cores) had
    another beside it (more threads than cores)."""
    events = sorted([(r[0], 1, not r[4]) for r in runs] + [(r[1], -1, not r[4]) for r in runs])
    spans = {0: 0.0, 1: 0.0, 2: 0.0}
    crowded = 0.0
    active = main = 0
    for (t, step, on_main), (t_next, _, _) in zip(events, events[1:], strict=False):
        active += step
        main += step if on_main else 0
        spans[min(active, 2)] += t_next - t
        crowded += (t_next - t) if main and active >= 2 else 0.0
    total = events[-1][0] - events[0][0]
    shares = ", ".join(f"{k}{'+' if k == 2 else ''} runs {v / total:.2f}" for k, v in spans.items())
    return f"time with {shares}; a main-session run beside another {crowded / total:.2f}"


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3], [f for f in sys.argv[4:] if f])
