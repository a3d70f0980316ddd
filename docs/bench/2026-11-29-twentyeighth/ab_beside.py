"""The batcher telling the engine of a batch beside (`beside`, twenty-eighth session) against the code just
before it, in alternated rounds.

BASE is a checkout of 023f169 installed in a venv of its own; this tree is the other. Each round starts each
server afresh with its defaults (`--graph auto`, grpc.aio's front) and measures with the bench's transports
and closed loop: short texts at 32 clients over gRPC and over HTTP (texts a second; the server's CPU a
request, and that of its threads other than the inference workers and the loop: ONNX Runtime's pool), then
one client over each (p50). Set up BASE and run from the repository root:
    git worktree add /tmp/base 023f169 && ln -s "$PWD/models" /tmp/base/models
    python3.11 -m venv /tmp/base/.venv && /tmp/base/.venv/bin/pip install -e /tmp/base
    python docs/bench/2026-11-29-twentyeighth/ab_beside.py /tmp/base/.venv/bin/python ROUNDS SECONDS
"""

import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
import regress  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402

POINTS = [("short", "grpc", 32), ("short", "http", 32), ("short", "grpc", 1), ("short", "http", 1)]


def measure(  # type: ignore[no-untyped-def]
    python: str,
    workloads,
    seconds: float,
    flags: tuple[str, ...] = ("--graph", "auto"),
    points: list[tuple[str, str, int]] = POINTS,
    grpc_client: str = "aio",
) -> dict[str, float]:
    """One server's points (ab_send.py passes its own flags, points and gRPC client); with 32 clients also the
    CPU a request of the server, its event loop, its other threads (ONNX Runtime's pool) and the client."""
    server, address, url = regress.start(python, Path("/tmp/ab-serve.log"), flags)
    out = {}
    try:
        for name, protocol, clients in points:
            link = transport(protocol, address, url, workloads[name], grpc_client=grpc_client)
            raw = asyncio.run(_closed_loop([(link, len(workloads[name].ids))], clients, seconds, 3 * seconds,
                                           [server.pid]))  # fmt: skip
            group, elapsed = raw["groups"][0], raw["window"][1] - raw["window"][0]
            key = f"{protocol} {clients}"
            if clients == 1:
                out[f"{key} p50 ms"] = statistics.median(group["latencies"])
                continue
            n = group["completed"]
            out[f"{key} seq/s"] = n / elapsed
            out[f"{key} server us"] = raw["server_cpu_s"] / n * 1e6
            threads = raw["server_threads_cpu_s"] or {}
            out[f"{key} loop us"] = threads.get("event loop", float("nan")) / n * 1e6
            out[f"{key} other us"] = threads.get("other", float("nan")) / n * 1e6
            out[f"{key} client us"] = raw["client_cpu_s"] / n * 1e6
    finally:
        server.terminate()
        server.wait(60)
    return out


def main(base: str, rounds: int, seconds: float) -> None:
    workloads = regress.workloads_of(["short"])
    versions = {"base": base, "beside": sys.executable}
    rows = regress.alternate({k: lambda p=p: measure(p, workloads, seconds) for k, p in versions.items()}, rounds)
    regress.print_ratios(rows, "base", "beside", rounds)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
