"""No regression on the fixed and mixed workloads? The server before issue 18's work against today's, alternated.

Issue 18 asks its changes not to slow the fixed (128 tokens, sent as ids) and mixed (corpus texts)
workloads. Ratios to the ceiling from runs days apart mix in the machine's drift and other changes to the
ceiling itself (spinning during runs made ONNX Runtime faster in process), so this runs both servers on
the same machine in alternated rounds: BASE, a checkout of the code before issue 18's server work
(9555cd6, the bench half of the issue only) installed in a venv of its own, and this tree's server.
Both serve this repository's `models/` (the fused graph, all-minilm-l6-v2) with their defaults.

Each round starts each server afresh and measures, with the bench's own transports and closed loop
(loadtest/bench/client.py) and its workloads (the same seeds and pools as `mhaserve bench`):
one gRPC client on mixed texts (p50), 32 gRPC clients on mixed texts, 32 HTTP clients (OpenAI route,
float) on mixed texts, and 32 gRPC clients on the fixed workload, SECONDS each; with WORKLOADS `short`,
one client (p50) and 32 clients over gRPC and over HTTP on the short texts instead (`short32`: the 32 only,
`short1`: the one client only).
Set up BASE and run from the repository root:
  git worktree add /tmp/base 9555cd6 && python3.11 -m venv /tmp/base/.venv
  /tmp/base/.venv/bin/pip install -e /tmp/base
  python docs/bench/2026-11-26-regress/regress.py /tmp/base/.venv/bin/python ROUNDS SECONDS [WORKLOADS]
"""

import asyncio
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mhaserve.loadtest.bench.client import _closed_loop
from mhaserve.loadtest.bench.transports import transport
from mhaserve.loadtest.bench.workloads import build
from mhaserve.runtime.repository import ModelRepository
from mhaserve.runtime.tokenizer import load_for_serving
from mhaserve.testing.loopback import free_ports

POINTS = {
    "fixed,mixed": [("mixed", "grpc", 1), ("mixed", "grpc", 32), ("mixed", "http", 32), ("fixed", "grpc", 32)],
    "short": [("short", "grpc", 1), ("short", "http", 1), ("short", "grpc", 32), ("short", "http", 32)],
    "short32": [("short", "grpc", 32), ("short", "http", 32)],
    "short1": [("short", "grpc", 1), ("short", "http", 1)],
}


def start(python: str, log: Path, flags: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], str, str]:
    """`python -m mhaserve.cli serve` on this repository's models, with `flags` added (ab_workers.py sets some)."""
    port, metrics, http = free_ports(3)
    cmd = [python, "-m", "mhaserve.cli", "serve", "--repository", "models", "--graph", "optimized",
           "--port", str(port), "--metrics-port", str(metrics), "--http-port", str(http), *flags]  # fmt: skip
    with log.open("w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while not re.search(r"serving all-minilm\S* version \d+ .*after", log.read_text()):
        if server.poll() is not None or time.time() > deadline:
            raise RuntimeError(log.read_text())
        time.sleep(0.2)
    time.sleep(1.0)
    return server, f"127.0.0.1:{port}", f"http://127.0.0.1:{http}"


def measure(python: str, workloads, points, seconds: float, flags: tuple[str, ...] = ()) -> dict[str, float]:  # type: ignore[no-untyped-def]
    server, address, url = start(python, Path("/tmp/regress-serve.log"), flags)
    out = {}
    try:
        for name, protocol, clients in points:
            link = transport(protocol, address, url, workloads[name])
            load = [(link, len(workloads[name].ids))]
            raw = asyncio.run(_closed_loop(load, clients, seconds, 3 * seconds, [server.pid]))
            group, elapsed = raw["groups"][0], raw["window"][1] - raw["window"][0]
            key = f"{name} {protocol} {clients}"
            if clients == 1:
                out[f"{key} p50 ms"] = statistics.median(group["latencies"])
            else:
                out[f"{key} seq/s"] = group["completed"] / elapsed
    finally:
        server.terminate()
        server.wait(60)
    return out


def workloads_of(names: list[str]):  # type: ignore[no-untyped-def]
    """The bench's workloads of these names, with its default seeds and pools, tokenised by models/'s."""
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    return build(names, tokenizer, max_seq_len=entry.manifest.max_seq_len, fixed_tokens=128,
                 fixed_pool=64, mixed_pool=256, short_pool=2000)  # fmt: skip


def main(base: str, rounds: int, seconds: float, which: str) -> None:
    points = POINTS[which]
    workloads = workloads_of(sorted({w for w, _, _ in points}))
    before = f"before ({revision(base)})"
    versions = {before: base, "now": sys.executable}
    rows = alternate({k: lambda p=p: measure(p, workloads, points, seconds) for k, p in versions.items()}, rounds)
    print_ratios(rows, before, "now", rounds)


def revision(python: str) -> str:
    """The commit of the checkout whose venv `python` is (BASE/.venv/bin/python), as `git` names it short."""
    checkout = Path(python).parents[2]
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or str(checkout)


def alternate(versions: dict[str, Callable[[], dict[str, float]]], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Each version's measure once a round, in alternated order (the first round in the order given, the next
    reversed, ...), each round's figures printed as they come: every measure's figures by version."""
    rows: dict[str, dict[str, list[float]]] = {v: {} for v in versions}
    for r in range(rounds):
        for name in versions if r % 2 == 0 else list(reversed(versions)):
            got = versions[name]()
            for k, v in got.items():
                rows[name].setdefault(k, []).append(v)
            print(f"round {r} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    return rows


def print_ratios(rows: dict[str, dict[str, list[float]]], base: str, new: str, rounds: int) -> None:
    """Each measure's medians over the rounds, and `new` against `base` as the median of the rounds' ratios."""
    print(f"medians of {rounds} rounds; {new} against {base} in the same round (median of the rounds' ratios):")
    before, now = rows[base], rows[new]
    for k in now:
        ratios = [n / b if b else float("nan") for n, b in zip(now[k], before[k], strict=True)]
        print(f"  {k:22s} {base} {statistics.median(before[k]):7.2f}  {new} {statistics.median(now[k]):7.2f}  "
              f"{new}/{base} {statistics.median(ratios):.3f} ({', '.join(f'{x:.2f}' for x in ratios)})")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "fixed,mixed")
