"""Queries sparser than one a second beside one indexing client: two versions of service/, alternated.

The nineteenth session's query_behind_bulk.py sends 10 queries a second; with the half budget's window of one
second (Batcher._budget), queries that come less often than that mostly meet batches of the whole budget. Here
one bulk client (64 short texts a request, the `openai` client, its own process) runs beside queries at RATE a
second (Poisson) for SECONDS, each version's server started afresh, in ROUNDS alternated rounds.
Run from the repository root:
  python docs/bench/2026-11-29-twentythird/sparse_queries.py BEFORE AFTER ROUNDS SECONDS RATE
"""

import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-28-nineteenth"))
import query_behind_bulk as q  # noqa: E402

from mhaserve.testing.loopback import free_port  # noqa: E402
from mhaserve.testing.process import ServerProcess  # noqa: E402


def one(seconds: float) -> dict[str, float]:
    port = free_port()
    flags = ["--repository", "models", "--graph", "optimized", "--port", "0", "--metrics-port", "0"]
    with ServerProcess([*flags, "--http-port", str(port)], Path("/tmp/sparse-serve.log")) as server:
        server.wait_serving()
        got = q.beside(port, 1, seconds)
        server.signal()
        server.wait()
    return got


def main(before: str, after: str, rounds: int, seconds: float, rate: float) -> None:
    q.RATE = rate
    versions = {"before": before, "after": after}
    rows: dict[str, dict[str, list[float]]] = {v: {} for v in versions}
    try:
        for r in range(rounds):
            for name in list(versions) if r % 2 == 0 else list(reversed(versions)):
                subprocess.run(["git", "checkout", versions[name], "--", "service"], check=True)
                got = one(seconds)
                for k, v in got.items():
                    rows[name].setdefault(k, []).append(v)
                print(f"round {r} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    finally:
        subprocess.run(["git", "checkout", "HEAD", "--", "service"], check=True)
    print(f"medians of {rounds} rounds (ms; texts a second), {rate} queries a second")
    for name, row in rows.items():
        print(f"{name} ({versions[name]}): " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in row.items()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
