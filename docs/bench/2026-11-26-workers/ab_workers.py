"""Server configurations against each other on short and mixed texts, alternated: one inference worker (the
default on 2 cores for fp32) against two, and the fused graph against int8.

The default stays one worker for the fused graph on 2 cores because two lengthened the tail on mixed texts
(p99 +16-30 % at 32 clients, 2026-11-24/25). Much of the server has changed since; this measures again,
with p50 and p99 beside throughput, each configuration started afresh every round, alternated.

Points, SECONDS each, with the bench's transports, closed loop and workloads (loadtest/bench): one gRPC
client on short texts (p50), 32 gRPC and 32 HTTP clients on short texts, 32 gRPC and 32 HTTP clients on
mixed texts (seq/s, p50, p99). CONFIG is NAME=FLAGS, flags separated by commas, e.g. 2w=--inference-workers=2.
Run from the repository root:
  python docs/bench/2026-11-26-workers/ab_workers.py ROUNDS SECONDS 1w= 2w=--inference-workers=2
  python docs/bench/2026-11-26-workers/ab_workers.py ROUNDS SECONDS fused= int8=--graph=int8
"""

import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
from regress import start  # noqa: E402  (the server started as regress.py starts it, with extra flags)

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402
from mhaserve.loadtest.bench.workloads import build  # noqa: E402
from mhaserve.loadtest.stats import latency_summary  # noqa: E402
from mhaserve.runtime.repository import ModelRepository  # noqa: E402
from mhaserve.runtime.tokenizer import load_for_serving  # noqa: E402

POINTS = [("short", "grpc", 1), ("short", "grpc", 32), ("short", "http", 32), ("mixed", "grpc", 32),
          ("mixed", "http", 32)]  # fmt: skip


def measure(flags: tuple[str, ...], workloads, seconds: float) -> dict[str, float]:  # type: ignore[no-untyped-def]
    server, address, url = start(sys.executable, Path("/tmp/ab-workers-serve.log"), flags)
    out = {}
    try:
        for name, protocol, clients in POINTS:
            link = transport(protocol, address, url, workloads[name])
            raw = asyncio.run(_closed_loop([(link, len(workloads[name].ids))], clients, seconds, 3 * seconds,
                                           [server.pid]))  # fmt: skip
            group, elapsed = raw["groups"][0], raw["window"][1] - raw["window"][0]
            latency = latency_summary(group["latencies"])
            key = f"{name} {protocol} {clients}"
            if clients > 1:
                out[f"{key} seq/s"] = group["completed"] / elapsed
            out[f"{key} p50"] = latency["p50"]
            if clients > 1:
                out[f"{key} p99"] = latency["p99"]
    finally:
        server.terminate()
        server.wait(60)
    return out


def main(rounds: int, seconds: float, configs: dict[str, tuple[str, ...]]) -> None:
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    workloads = build(["short", "mixed"], tokenizer, max_seq_len=entry.manifest.max_seq_len, fixed_tokens=128,
                      fixed_pool=64, mixed_pool=256, short_pool=2000)  # fmt: skip
    rows: dict[str, dict[str, list[float]]] = {c: {} for c in configs}
    names = list(configs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else list(reversed(names)):
            got = measure(configs[name], workloads, seconds)
            for k, v in got.items():
                rows[name].setdefault(k, []).append(v)
            print(f"round {r} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    first = names[0]
    print(f"medians of {rounds} rounds (ms, seq/s); each against {first} in the same round (median of the ratios):")
    for k in rows[first]:
        line = f"  {k:22s}" + "".join(f" {n} {statistics.median(rows[n][k]):7.1f}" for n in names)
        for n in names[1:]:
            ratios = [a / b for a, b in zip(rows[n][k], rows[first][k], strict=True)]
            line += f"  {n}/{first} {statistics.median(ratios):.3f} ({', '.join(f'{x:.2f}' for x in ratios)})"
        print(line)


def cli(argv: list[str]) -> None:
    """ROUNDS SECONDS NAME=FLAGS...: `main` on those configurations (this script's and its variants' command line)."""
    parsed = {}
    for arg in argv[2:]:
        name, _, flags = arg.partition("=")
        parsed[name] = tuple(f for f in flags.split(",") if f)
    main(int(argv[0]), float(argv[1]), parsed)


if __name__ == "__main__":
    cli(sys.argv[1:])
