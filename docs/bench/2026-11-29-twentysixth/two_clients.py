"""Are two clients of 128-token inputs served fewer texts a second than one? The full run's sweep said so for
arrival order (87.8 against 98.2) and the opposite for the length policy (88.3 against 83.3): single points.

Alternated rounds, each server started afresh (regress.py's `start`, today's tree): the default server (two
inference workers) at 1, 2 and 4 gRPC clients on the fixed workload, and one with `--inference-workers 1`
at the same counts, SECONDS each. From the repository root:
  python docs/bench/2026-11-29-twentysixth/two_clients.py ROUNDS SECONDS
"""

import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
import regress  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402

SERVERS = {"two workers": ("--graph", "auto"), "one worker": ("--graph", "auto", "--inference-workers", "1")}
CLIENTS = (1, 2, 4)


def measure(flags: tuple[str, ...], workload, seconds: float) -> dict[int, float]:  # type: ignore[no-untyped-def]
    server, address, url = regress.start(sys.executable, Path("/tmp/two-clients-serve.log"), flags)
    try:
        out = {}
        for clients in CLIENTS:
            link = transport("grpc", address, url, workload)
            raw = asyncio.run(_closed_loop([(link, len(workload.ids))], clients, seconds, 3 * seconds, [server.pid]))
            group, elapsed = raw["groups"][0], raw["window"][1] - raw["window"][0]
            out[clients] = group["completed"] / elapsed
        return out
    finally:
        server.terminate()
        server.wait(60)


def main(rounds: int, seconds: float) -> None:
    workload = regress.workloads_of(["fixed"])["fixed"]
    rows: dict[str, dict[int, list[float]]] = {name: {c: [] for c in CLIENTS} for name in SERVERS}
    for r in range(rounds):
        for name in SERVERS if r % 2 == 0 else list(reversed(SERVERS)):
            got = measure(SERVERS[name], workload, seconds)
            for c, v in got.items():
                rows[name][c].append(v)
            print(f"round {r} {name}: " + ", ".join(f"{c} clients {v:.1f}/s" for c, v in got.items()), flush=True)
    print(f"texts a second, medians of {rounds} rounds (each round's values in brackets):")
    for name, by in rows.items():
        print(f"  {name:12s} " + "  ".join(f"{c}: {statistics.median(v):6.1f} ({', '.join(f'{x:.0f}' for x in v)})"
                                          for c, v in by.items()))  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
