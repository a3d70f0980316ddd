"""The lean front's answers written once a turn of the event loop (cork.patch: `_write` gathers a connection's
frames and one `call_soon` writes them together) against a write per answer, on a server whose model is a
scripted engine (each batch sleeps SLOW seconds), alternated: each round starts a server of either arm afresh
and measures gRPC with grpc.aio's client and the bench's HTTP/2 client, at 32 clients and one, SECONDS each.
The patch reads MHASERVE_CORK; apply it first (`git apply`), and take it out after. From the repository root:
    git apply docs/bench/2026-12-04-fiftyeighth/cork.patch
    python docs/bench/2026-12-04-fiftyeighth/ab_cork.py ROUNDS SECONDS SLOW
    git apply -R docs/bench/2026-12-04-fiftyeighth/cork.patch
"""

import asyncio
import os
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH / "2026-11-29-twentyeighth"))
sys.path.insert(0, str(BENCH / "2026-11-26-regress"))
from profile_fake import start_fake  # noqa: E402
from regress import workloads_of  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402


def main(rounds: int, seconds: float, slow: str) -> None:
    workload = workloads_of(["short"])["short"]
    got: dict[tuple[str, int, str], list[tuple[float, float, float]]] = {}
    for r in range(rounds):
        for arm in ["base", "cork"] if r % 2 == 0 else ["cork", "base"]:
            if arm == "cork":
                os.environ["MHASERVE_CORK"] = "1"
            else:
                os.environ.pop("MHASERVE_CORK", None)
            server, port, http = start_fake([sys.executable], slow, ["--grpc-front", "lean"], Path("/tmp/ab-cork.log"))
            try:
                for client in ("aio", "h2"):
                    for clients in (32, 1):
                        link = transport("grpc", f"127.0.0.1:{port}", f"http://127.0.0.1:{http}", workload,
                                         grpc_client=client)  # fmt: skip
                        raw = asyncio.run(
                            _closed_loop([(link, len(workload.ids))], clients, seconds, 2.0, [server.pid])
                        )
                        group, elapsed = raw["groups"][0], raw["window"][1] - raw["window"][0]
                        n = group["completed"]
                        got.setdefault((client, clients, arm), []).append(
                            (n / elapsed, raw["server_cpu_s"] / n * 1e6, statistics.median(group["latencies"]))
                        )
            finally:
                server.terminate()
                server.wait(30)
        print("round", r, "done", flush=True)
    for client in ("aio", "h2"):
        for clients in (32, 1):
            base, cork = got[(client, clients, "base")], got[(client, clients, "cork")]

            def med(xs: list[tuple[float, float, float]], i: int) -> float:
                return statistics.median(x[i] for x in xs)

            by_round = [round(c[1] / b[1], 3) for b, c in zip(base, cork, strict=True)]
            print(f"{client} {clients:2d} clients: texts/s {med(base, 0):.1f} -> {med(cork, 0):.1f}; "
                  f"server CPU us a request {med(base, 1):.0f} -> {med(cork, 1):.0f}; "
                  f"p50 ms {med(base, 2):.3f} -> {med(cork, 2):.3f}; CPU cork/base by round {by_round}")  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
