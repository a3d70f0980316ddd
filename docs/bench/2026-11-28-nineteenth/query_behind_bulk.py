"""A query's latency while indexing clients send bulk requests: two versions of service/, alternated.

Each round checks out each version's service/ (the editable install serves them), starts the server
(defaults, the fused graph) and measures, over HTTP with the `openai` client:
- queries alone: one short text a request, 10 a second at random times (open loop), SECONDS;
- the same queries beside 1, then 2, bulk clients, each in a process of its own sending 64 short
  texts a request (the openai client's default base64 encoding, `truncate`), back to back: the query's
  latencies (p50, p90, p99, mean) and the bulk clients' texts a second;
then 32 closed-loop gRPC clients of one short text a request (ab_turns.py's), the single-text throughput
the change must not cost. The working tree's service/ is restored at the end.
Run from the repository root: python query_behind_bulk.py BEFORE AFTER ROUNDS SECONDS
AB_ARGS_BEFORE and AB_ARGS_AFTER add server flags to each version's server (the same commit twice then
compares settings).
"""

import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

TEXTS = [line for line in Path("loadtest/texts/short.txt").read_text().splitlines() if line.strip()]
PER = 64
# ab_turns.py's 32 gRPC clients (it imports one_client.py from docs/bench), once for every round.
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "2026-11-26-turns"), str(Path(__file__).resolve().parents[1])]
RATE = 10.0  # queries a second


def bulk(port: int, seconds: float, offset: int) -> None:
    """A bulk client: 64 texts a request until `seconds` pass; prints how many texts were embedded."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
    stop, k, done = time.perf_counter() + seconds, offset, 0
    while time.perf_counter() < stop:
        batch = [TEXTS[(k + j) % len(TEXTS)] for j in range(PER)]
        k += PER
        done += len(client.embeddings.create(model="all-minilm-l6-v2", input=batch, extra_body={"truncate": True}).data)
    print(done, flush=True)


def queries(port: int, seconds: float) -> list[float]:
    """Queries at random times (Poisson, RATE a second, whatever the server is doing, as users of a search box
    send them), one short text each, from a pool of clients: milliseconds from each query's time to its
    answer. A closed-loop client instead sends most of its queries when the server is quick and few while it
    is slow, and its percentiles flatter whatever makes waits uneven."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    clients = [OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0) for _ in range(8)]
    free = list(clients)

    def one(k: int, due: float) -> float:
        client = free.pop()
        try:
            client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS[k % 1000], extra_body={"truncate": True})
        finally:
            free.append(client)
        return (time.perf_counter() - due) * 1000

    for c in clients:  # warm-up: a connection each
        c.embeddings.create(model="all-minilm-l6-v2", input=TEXTS[0])
    rng, due, k = random.Random(7), time.perf_counter(), 0
    stop, calls = due + seconds, []
    with ThreadPoolExecutor(len(clients)) as pool:
        while (due := due + rng.expovariate(RATE)) < stop:
            time.sleep(max(0.0, due - time.perf_counter()))
            calls.append(pool.submit(one, k, due))
            k += 1
        return [c.result() for c in calls]


def beside(port: int, n_bulk: int, seconds: float) -> dict[str, float]:
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "bulk", str(port), str(seconds + 2), str(1000 + 500 * i)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(n_bulk)
    ]
    time.sleep(1.0 if n_bulk else 0)  # the bulk clients under way first
    lat = sorted(queries(port, seconds))
    texts = sum(int(p.communicate()[0].split()[-1]) for p in procs)
    q = lambda f: lat[min(len(lat) - 1, int(len(lat) * f))]  # noqa: E731
    return {
        f"q{n_bulk} p50": q(0.5), f"q{n_bulk} p90": q(0.9), f"q{n_bulk} p99": q(0.99),
        f"q{n_bulk} mean": statistics.fmean(lat), f"bulk{n_bulk}/s": texts / (seconds + 2),
    }  # fmt: skip


def served(seconds: float, args: list[str]) -> dict[str, float]:
    from ab_turns import grpc_32

    from mhaserve.testing.loopback import free_port
    from mhaserve.testing.process import ServerProcess

    port = free_port()
    server = ServerProcess(
        ["--repository", "models", "--graph", "optimized", "--port", "0", "--metrics-port", "0",
         "--http-port", str(port), *args],
        Path("/tmp/query-behind-bulk-serve.log"),
    )  # fmt: skip
    got: dict[str, float] = {}
    with server:
        address = server.wait_serving()
        for n in (0, 1, 2):
            got |= beside(port, n, seconds)
        got["gRPC 32/s"] = asyncio.run(grpc_32(address, seconds))
        server.signal()
        server.wait()
    return got


def main(before: str, after: str, rounds: int, seconds: float) -> None:
    versions = {"before": before, "after": after}
    rows: dict[str, dict[str, list[float]]] = {v: {} for v in versions}
    try:
        for r in range(rounds):
            for name in list(versions) if r % 2 == 0 else list(reversed(versions)):
                subprocess.run(["git", "checkout", versions[name], "--", "service"], check=True)
                got = served(seconds, shlex.split(os.environ.get(f"AB_ARGS_{name.upper()}", "")))
                for k, v in got.items():
                    rows[name].setdefault(k, []).append(v)
                print(f"round {r} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    finally:
        subprocess.run(["git", "checkout", "HEAD", "--", "service"], check=True)
    print(f"medians of {rounds} rounds (ms; texts a second)")
    for name, row in rows.items():
        print(f"{name} ({versions[name]}): " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in row.items()))


if __name__ == "__main__":
    if sys.argv[1] == "bulk":
        bulk(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    else:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
