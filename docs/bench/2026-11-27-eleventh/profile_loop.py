"""32 closed-loop clients of the short texts for SECONDS over gRPC or HTTP against a plain server, with py-spy
recording the server meanwhile (non-blocking, 200 samples a second); prints throughput and, for the event loop's
thread, the frames most often on top and most often on the stack. For the loop's CPU by library, perf instead,
while it runs: `perf record -F 1999 -t <server pid> -- sleep 12` and `perf report --sort dso`.
Run from the repository root:
  python docs/bench/2026-11-27-eleventh/profile_loop.py SECONDS grpc|http OUT.txt
"""

import asyncio
import collections
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-27-eighth"))
from trace_fixed import start, workload  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402


def top(raw: Path, thread: str = "MainThread", n: int = 25) -> None:
    """py-spy's raw (collapsed) stacks of one thread: the frames on top, and on the stack, by share of samples."""
    self_count: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        if thread not in stack.split(";", 1)[0]:
            continue
        frames = stack.split(";")[1:]
        total += int(count)
        if not frames:
            continue
        self_count[frames[-1]] += int(count)
        for name in {f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] for f in frames if " (" in f}:
            inclusive[name] += int(count)
    print(f"{thread}: {total} samples; on top:")
    for frame, k in self_count.most_common(n):
        print(f"  {100 * k / total:5.1f} % {frame[:140]}")
    print("on the stack:")
    for frame, k in inclusive.most_common(2 * n):
        print(f"  {100 * k / total:5.1f} % {frame[:140]})")


def main(seconds: float, protocol: str, out: Path) -> None:
    work = workload("short")
    server, port, http = start("profile", [], None)
    try:
        link = transport(protocol, f"127.0.0.1:{port}", f"http://127.0.0.1:{http}", work)
        spy = subprocess.Popen(
            [str(Path(sys.executable).with_name("py-spy")), "record", "-p", str(server.pid), "-d", str(int(seconds)),
             "-r", "200", "-f", "raw", "-o", str(out), "--threads", "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        raw = asyncio.run(_closed_loop([(link, len(work.ids))], 32, seconds, 3 * seconds, [server.pid]))
        spy.wait(60)
    finally:
        server.terminate()
        server.wait(60)
    group, elapsed = raw["groups"][0], raw["window"][1] - raw["window"][0]
    print(f"{protocol}: {group['completed'] / elapsed:.1f} seq/s (py-spy attached); CPU s by thread "
          f"{raw['server_threads_cpu_s']}")  # fmt: skip
    top(out)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
