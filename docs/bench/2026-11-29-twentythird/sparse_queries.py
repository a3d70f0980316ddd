"""Queries sparser than one a second beside one indexing client: two versions of service/, alternated.

The nineteenth session's query_behind_bulk.py sends 10 queries a second; with the half budget's window of one
second (Batcher._budget), queries that come less often than that mostly meet batches of the whole budget. Here
one bulk client (64 short texts a request, the `openai` client, its own process) runs beside queries at RATE a
second (Poisson) for SECONDS, each version's server started afresh, in ROUNDS alternated rounds.
Run from the repository root:
  python docs/bench/2026-11-29-twentythird/sparse_queries.py BEFORE AFTER ROUNDS SECONDS RATE
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-28-nineteenth"))
import query_behind_bulk as q  # noqa: E402

from mhaserve.testing.loopback import free_port  # noqa: E402
from mhaserve.testing.process import ServerProcess  # noqa: E402


def one(seconds: float, args: list[str]) -> dict[str, float]:
    """In place of q.served: one bulk client beside the queries, nothing else (q.main alternates the versions)."""
    port = free_port()
    flags = ["--repository", "models", "--graph", "optimized", "--port", "0", "--metrics-port", "0"]
    with ServerProcess([*flags, "--http-port", str(port), *args], Path("/tmp/sparse-serve.log")) as server:
        server.wait_serving()
        got = q.beside(port, 1, seconds)
        server.signal()
        server.wait()
    return got


def main(before: str, after: str, rounds: int, seconds: float, rate: float) -> None:
    q.RATE = rate
    q.served = one
    print(f"{rate} queries a second beside one bulk client", flush=True)
    q.main(before, after, rounds, seconds)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
