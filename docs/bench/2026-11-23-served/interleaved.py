"""Where the server's gap to the ceiling goes on short texts at 32 clients, measured interleaved.

Each round measures, in a rotated order: the ceiling (ONNX Runtime in this process, the workload sorted
by length in batches of --batch-size, tokenisation counted), the server's own batches for 32 clients
timed the same way (`served_batches`: the length policy replayed with nothing but the model taking time),
and the server at 32 closed-loop clients over gRPC and over HTTP (POST /v1/embeddings), with the bench's
own clients. A shared machine drifts by 10-20 % over minutes; the medians of per-round ratios do not.

    .venv/bin/python docs/bench/2026-11-23-served/interleaved.py --rounds 6

Run for docs/benchmarks.md ("Where the short-text gap goes"); not part of the package or of the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from mhaserve.loadtest.bench import workloads
from mhaserve.loadtest.bench.client import Server, _closed_loop
from mhaserve.loadtest.bench.inprocess import _pad, batches, served_batches, timed_passes
from mhaserve.loadtest.bench.transports import transport
from mhaserve.runtime.repository import ModelRepository, onnx_engine
from mhaserve.runtime.tokenizer import load_for_serving
from mhaserve.service.batching.limits import CPU_LIMITS

CLIENTS = 32


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", default="models")
    p.add_argument("--model", default="all-minilm-l6-v2")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8, help="the ceiling's batch size (the bench's best, here)")
    p.add_argument("--inprocess-seconds", type=float, default=10.0)
    p.add_argument("--server-seconds", type=float, default=15.0)
    args = p.parse_args()

    entry = ModelRepository(Path(args.repository)).entry(args.model, graph="auto")
    engine = onnx_engine("cpu", None)(entry)  # the session the server opens, options included
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    w = workloads.short(tokenizer, workloads.load_corpus(workloads.SHORT), pool=2000)

    def run(idx: list[int]) -> int:
        ids, mask = _pad([e.ids for e in tokenizer.encode_batch([w.texts[i] for i in idx])], entry.manifest.pad_id)
        engine.run(ids, mask)
        return int(ids.size)

    plans = {
        "ceiling": batches(w, args.batch_size),
        "served": served_batches(w, CLIENTS, max_padding=CPU_LIMITS.max_padding, budget=CPU_LIMITS.max_batch_tokens),
    }

    def inprocess(name: str) -> float:
        t = timed_passes(run, plans[name], args.inprocess_seconds)
        return float(t["sequences"] / t["seconds"])

    with tempfile.TemporaryDirectory() as tmp:
        server = Server(
            Path(args.repository),
            models=[args.model],
            batching="length",
            graph="auto",
            device="cpu",
            threads=None,
            extra=[],
            log_path=Path(tmp) / "server.log",
        )
        with server.running():
            assert server.proc is not None

            def served_by(protocol: str) -> float:
                link = transport(protocol, server.address, server.http_url, w)
                raw = asyncio.run(_closed_loop([(link, len(w.ids))], CLIENTS, args.server_seconds, 60, server.pid))
                cycles = raw["groups"][0]["cycles"]
                return CLIENTS / (sum(cycles) / len(cycles))  # Little's law, as the bench reports it

            steps: list[tuple[str, Callable[[], float]]] = [
                ("ceiling", lambda: inprocess("ceiling")),
                ("served", lambda: inprocess("served")),
                ("grpc", lambda: served_by("grpc")),
                ("http", lambda: served_by("http")),
            ]
            seen: dict[str, list[float]] = {name: [] for name, _ in steps}
            for r in range(args.rounds):
                k = r % len(steps)
                for name, measure in steps[k:] + steps[:k]:
                    seen[name].append(measure())
                print(f"round {r + 1}: " + "  ".join(f"{n} {seen[n][-1]:.1f}" for n, _ in steps), flush=True)

    print(f"the server's batches for {CLIENTS} clients: mean {len(w.ids) / len(plans['served']):.2f} inputs")
    for a, b in (
        ("served", "ceiling"),
        ("grpc", "ceiling"),
        ("http", "ceiling"),
        ("grpc", "served"),
        ("http", "served"),
    ):
        ratios = [x / y for x, y in zip(seen[a], seen[b], strict=True)]
        print(f"{a} / {b}: median {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
