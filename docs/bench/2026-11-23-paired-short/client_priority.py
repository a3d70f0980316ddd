"""Does a lower-priority load generator change the server's throughput at 32 clients? Interleaved rounds.

Each round measures, in a rotated order: the ceiling (ONNX Runtime in this process, batch 4, sorted,
tokenisation counted), and the server at 32 clients over gRPC and over HTTP with the load generator (this
process) at its usual priority and at nice 10. On two shared cores the generator's CPU competes with the
server's; at a lower priority it would yield to the model's threads, as a generator on another machine
would. Run as root (restoring the priority needs it), from the repository root, for docs/benchmarks.md:

    .venv/bin/python docs/bench/2026-11-23-paired-short/client_priority.py --rounds 10 --seconds 12

Not part of the package or of the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from mhaserve.loadtest.bench import workloads
from mhaserve.loadtest.bench.client import Server, _closed_loop
from mhaserve.loadtest.bench.inprocess import _pad, batches, timed_passes
from mhaserve.loadtest.bench.transports import transport
from mhaserve.runtime.repository import ModelRepository, onnx_engine
from mhaserve.runtime.tokenizer import load_for_serving

CLIENTS = 32
MODEL = "all-minilm-l6-v2"


def renice(niceness: int) -> None:
    """Every thread of this process (Linux sets priorities per thread)."""
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seconds", type=float, default=12.0, help="per server point")
    args = p.parse_args()

    entry = ModelRepository(Path("models")).entry(MODEL, graph="auto")
    engine = onnx_engine("cpu", None)(entry)  # the session the server opens, options included
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    w = workloads.short(tokenizer, workloads.load_corpus(workloads.SHORT), pool=2000)

    def run(idx: list[int]) -> int:
        ids, mask = _pad([e.ids for e in tokenizer.encode_batch([w.texts[i] for i in idx])], entry.manifest.pad_id)
        engine.run(ids, mask)
        return int(ids.size)

    plan = batches(w, 4)

    def ceiling() -> float:
        t = timed_passes(run, plan, 10.0)
        return float(t["sequences"] / t["seconds"])

    with tempfile.TemporaryDirectory() as tmp:
        server = Server(
            Path("models"),
            models=[MODEL],
            batching="length",
            graph="auto",
            device="cpu",
            threads=None,
            extra=[],
            log_path=Path(tmp) / "server.log",
        )
        with server.running():

            def served_by(protocol: str, niceness: int) -> float:
                renice(niceness)
                try:
                    link = transport(protocol, server.address, server.http_url, w)
                    raw = asyncio.run(_closed_loop([(link, len(w.ids))], CLIENTS, args.seconds, 60, server.pid))
                finally:
                    renice(0)
                cycles = raw["groups"][0]["cycles"]
                return CLIENTS / (sum(cycles) / len(cycles))  # Little's law, as the bench reports it

            steps: list[tuple[str, Callable[[], float]]] = [
                ("ceiling", ceiling),
                ("grpc", lambda: served_by("grpc", 0)),
                ("grpc_nice", lambda: served_by("grpc", 10)),
                ("http", lambda: served_by("http", 0)),
                ("http_nice", lambda: served_by("http", 10)),
            ]
            seen: dict[str, list[float]] = {name: [] for name, _ in steps}
            for r in range(args.rounds):
                k = r % len(steps)
                for name, measure in steps[k:] + steps[:k]:
                    seen[name].append(measure())
                print(f"round {r + 1}: " + "  ".join(f"{n} {seen[n][-1]:.1f}" for n, _ in steps), flush=True)

    for a, b in (
        ("grpc", "ceiling"),
        ("grpc_nice", "ceiling"),
        ("http", "ceiling"),
        ("http_nice", "ceiling"),
        ("grpc_nice", "grpc"),
        ("http_nice", "http"),
    ):
        ratios = [x / y for x, y in zip(seen[a], seen[b], strict=True)]
        print(f"{a}/{b} median {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
