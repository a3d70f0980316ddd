"""A/B/C of the server's code at several commits, with the scripted engine (5 ms asleep a batch, no model):
at 32 clients, calls a second and the server's CPU per call (floor_load.py's clients); at one client, the
p50 less the engine's 5 ms (floor.py's clients). Over HTTP and gRPC, alternated in rounds; each round
checks out each commit's service/ (the editable install serves it) and restores the working tree's at
the end. Run from the repository root: python docs/bench/2026-11-26-floor/ab_gil.py ROUNDS SECONDS REV...
"""

import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import floor
import floor_load

KINDS = ["http-ours", "grpc-ours"]


def main() -> None:
    rounds, seconds, revs = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    rows: dict[tuple[str, str], list[tuple[float, float, float]]] = {(r, k): [] for r in revs for k in KINDS}
    try:
        for r in range(rounds):
            for rev in revs if r % 2 == 0 else list(reversed(revs)):
                subprocess.run(["git", "checkout", rev, "--", "service"], check=True)
                for kind in KINDS:
                    rate, cpu = floor_load.measure(kind, seconds)
                    p50, _ = floor.measure(kind)
                    rows[(rev, kind)].append((rate, cpu, p50))
                    print(f"round {r} {rev} {kind}: 32 clients {rate:.0f}/s, {cpu:.0f} us CPU a call; "
                          f"one client {p50:.2f} ms", flush=True)  # fmt: skip
    finally:
        subprocess.run(["git", "checkout", "HEAD", "--", "service"], check=True)
    print("medians of the rounds: 32 clients (calls a second, server CPU a call), one client (p50 less 5 ms)")
    for (rev, kind), values in rows.items():
        rate, cpu, p50 = (statistics.median(column) for column in zip(*values, strict=True))
        print(f"  {rev} {kind}: {rate:.0f}/s, {cpu:.0f} us; {p50:.2f} ms")


if __name__ == "__main__":
    main()
