"""The lean gRPC front against grpc.aio's, the same server otherwise, in alternated rounds.

Each round starts both servers afresh (this tree, its defaults: `--graph auto`), one with `--grpc-front
lean`, and measures with the bench's transports and closed loop (regress.py's `measure`, the fifth
session's): short texts over gRPC at 32 clients and at one, and over HTTP at 32 as a check that the rest
of the server is the same. Run from the repository root:
    python docs/bench/2026-11-29-twentyseventh/ab_front.py ROUNDS SECONDS
"""

import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
import regress  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402

FLAGS = {"grpc.aio": ("--graph", "auto"), "lean": ("--graph", "auto", "--grpc-front", "lean")}
POINTS = [("short", "grpc", 32), ("short", "grpc", 1), ("short", "http", 32)]


def measure(workloads, flags: tuple[str, ...], seconds: float) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """regress.measure's points, with the CPU a request of the server, its event loop's thread and the load
    generator at 32 clients."""
    server, address, url = regress.start(sys.executable, Path("/tmp/ab-front-serve.log"), flags)
    out = {}
    try:
        for name, protocol, clients in POINTS:
            link = transport(protocol, address, url, workloads[name])
            load = [(link, len(workloads[name].ids))]
            raw = asyncio.run(_closed_loop(load, clients, seconds, 3 * seconds, [server.pid]))
            group, elapsed = raw["groups"][0], raw["window"][1] - raw["window"][0]
            key = f"{name} {protocol} {clients}"
            if clients == 1:
                out[f"{key} p50 ms"] = statistics.median(group["latencies"])
                continue
            n = group["completed"]
            out[f"{key} seq/s"] = n / elapsed
            out[f"{key} server us"] = raw["server_cpu_s"] / n * 1e6
            out[f"{key} loop us"] = (raw["server_threads_cpu_s"] or {}).get("event loop", float("nan")) / n * 1e6
            out[f"{key} client us"] = raw["client_cpu_s"] / n * 1e6
    finally:
        server.terminate()
        server.wait(60)
    return out


def main(rounds: int, seconds: float) -> None:
    workloads = regress.workloads_of(["short"])
    rows: dict[str, dict[str, list[float]]] = {v: {} for v in FLAGS}
    for r in range(rounds):
        for name in FLAGS if r % 2 == 0 else list(reversed(FLAGS)):
            got = measure(workloads, FLAGS[name], seconds)
            for k, v in got.items():
                rows[name].setdefault(k, []).append(v)
            print(f"round {r} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    print(f"medians of {rounds} rounds; lean against grpc.aio in the same round (median of the rounds' ratios):")
    base, lean = rows["grpc.aio"], rows["lean"]
    for k in lean:
        ratios = [n / b for n, b in zip(lean[k], base[k], strict=True)]
        print(f"  {k:22s} grpc.aio {statistics.median(base[k]):7.2f}  lean {statistics.median(lean[k]):7.2f}  "
              f"lean/grpc.aio {statistics.median(ratios):.3f} ({', '.join(f'{x:.2f}' for x in ratios)})")  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
