"""A query alone at random times (Poisson, RATE a second, as the bench's queries beside indexing clients with no
bulk client), served over HTTP, against ONNX Runtime in process on the same texts at the same kind of times (the
fused graph, every core, tokeniser counted); and one text at a time back to back, both ways, in the same rounds.
Run from the repository root:
  python docs/bench/2026-11-29-twentythird/sporadic.py ROUNDS SECONDS [RATE]
"""

import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import one_client as oc  # noqa: E402

from mhaserve.loadtest.bench import beside  # noqa: E402
from mhaserve.testing.loopback import free_ports  # noqa: E402
from mhaserve.testing.process import ServerProcess  # noqa: E402


def in_process_sporadic(run, texts, seconds: float, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    out, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        time.sleep(rng.expovariate(rate))
        t = texts[rng.randrange(len(texts))]
        t0 = time.perf_counter()
        run(t)
        out.append(1000 * (time.perf_counter() - t0))
    return out


def main(rounds: int, seconds: float, rate: float) -> None:
    texts = oc.SHORT_TEXTS
    run = oc.in_process()
    grpc_port, http_port = free_ports(2)
    flags = ["--repository", "models", "--graph", "optimized", "--port", str(grpc_port), "--http-port", str(http_port)]
    url = f"http://127.0.0.1:{http_port}"
    rows = []
    with ServerProcess(flags, Path("/tmp/sporadic-server.log")) as server:
        server.wait_serving()
        oc.p50_ms(run, texts[:20])
        asyncio.run(oc.http_latencies(http_port, texts[:20]))
        for r in range(rounds):
            res = {}

            def served_sporadic(seed: int = r) -> float:
                return asyncio.run(beside.measure(url, texts, 0, seconds, rate, seed))["latency_ms"]["p50"]

            def in_process(seed: int = r) -> float:
                return statistics.median(in_process_sporadic(run, texts, seconds, rate, seed))

            def served_back_to_back() -> float:
                return 1000 * statistics.median(asyncio.run(oc.http_latencies(http_port, texts[:400])))

            steps = {
                "served sporadic": served_sporadic,
                "in process sporadic": in_process,
                "served back to back": served_back_to_back,
                "in process back to back": lambda: oc.p50_ms(run, texts[:400]),
            }
            order = list(steps)[r % 4 :] + list(steps)[: r % 4]
            for k in order:
                res[k] = steps[k]()
            rows.append(res)
            print(f"round {r}: " + ", ".join(f"{k} {res[k]:.2f}" for k in steps) + " ms (p50)", flush=True)
    for k in rows[0]:
        print(f"{k}: median of {rounds} rounds' p50s {statistics.median(x[k] for x in rows):.2f} ms")
    for mode in ("sporadic", "back to back"):
        gap = statistics.median(x[f"served {mode}"] - x[f"in process {mode}"] for x in rows)
        print(f"served - in process, {mode}: {gap:+.2f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 10.0)
