"""Queries beside indexing clients: an interactive query's latency while bulk requests keep the model busy.

Real traffic mixes interactive queries (one short text, someone waiting for it) with indexing jobs that send
many texts a request (the `openai` client and LangChain send lists); the sweep's workloads send one kind each.
Here, over the OpenAI route as the clients that index use it (`encoding_format` base64, the official
client's default):
- `bulk` clients, each on a connection of its own, send BULK_INPUTS short texts a request, back to back;
- queries come at random times (Poisson, `rate` a second), whatever the server is doing, as users of a search
  box send them, one short text each, on connections from a pool. A closed-loop query client would send most
  of its queries while the server is quick and few while it is slow, and flatter every percentile.
A query's latency runs from when it was due to its answer: a send the load generator makes late counts
against the server, not for it. With no bulk client the queries run alone, the reference, and the bench replays
the same queries in process (`schedule`; inprocess.replay), the reference under that one. docs/benchmarks.md
measured the same with a process per client (the nineteenth and twenty-second sessions' query_behind_bulk.py);
here every client shares the bench's one event loop, which costs the queries a little of their own time when
a bulk answer is read.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

from mhaserve.loadtest.bench.transports import CallFailed, HttpConnection, call, http_address, http_request
from mhaserve.loadtest.stats import latency_summary

BULK_INPUTS = 64  # a common indexing chunk, as the benchmarks since the nineteenth session sent
WARMUP_S = 1.0  # bulk clients run alone first, so that the first queries meet a server already busy with them
ENCODING = "base64"


def schedule(n_texts: int, seconds: float, rate: float, seed: int) -> list[tuple[float, int]]:
    """The queries of a run: (seconds from the start when it is due, which text), Poisson at `rate` a second
    for `seconds`. The same seed gives the same queries, so the in-process reference (inprocess.py) replays
    what the server was sent."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < seconds:
        offsets.append(t)
    return [(t, rng.randrange(n_texts)) for t in offsets]


async def measure(
    url: str, texts: Sequence[str], bulk: int, seconds: float, rate: float, seed: int, model: str = ""
) -> dict[str, Any]:
    """Queries for `seconds` beside `bulk` bulk clients on the server at `url` (http://host:port): the queries'
    latencies (ms) and the bulk clients' texts answered a second within the same window."""
    host, port, netloc = http_address(url)
    # Every request built once, whole, before the run, as the sweep's clients do: the bulk requests are the
    # texts in chunks of BULK_INPUTS, in turn (each client starting at its own chunk), the queries one text each.
    chunks = [
        http_request(netloc, [texts[(i + j) % len(texts)] for j in range(BULK_INPUTS)], ENCODING, model)
        for i in range(0, len(texts), BULK_INPUTS)
    ]
    requests = [http_request(netloc, [text], ENCODING, model) for text in texts]
    loop = asyncio.get_running_loop()
    errors: Counter[str] = Counter()
    window = (0.0, 0.0)
    bulk_answers: list[float] = []  # when each bulk request was answered
    stopping = asyncio.Event()

    async def bulk_client(k: int) -> None:
        connection = HttpConnection(host, port)
        i = k * len(chunks) // max(1, bulk)  # the clients start at different places in the texts
        try:
            while not stopping.is_set():
                raw = chunks[i % len(chunks)]
                i += 1
                try:
                    await call(connection, raw, BULK_INPUTS)
                except CallFailed as e:
                    errors[f"bulk: {e.key}"] += 1
                    await asyncio.sleep(0.05)  # a refused client backs off rather than spin on the refusal
                    continue
                bulk_answers.append(loop.time())
        finally:
            connection.close()

    pool: list[HttpConnection] = []
    latencies: list[float] = []

    async def query(due: float, raw: bytes) -> None:
        await asyncio.sleep(due - loop.time())
        connection = pool.pop() if pool else HttpConnection(host, port)
        try:
            await call(connection, raw, 1)
            latencies.append((loop.time() - due) * 1000)
        except CallFailed as e:
            errors[f"query: {e.key}"] += 1
        finally:
            pool.append(connection)  # a connection closed by a failure opens again on its next request

    clients = [asyncio.create_task(bulk_client(k)) for k in range(bulk)]
    try:
        if bulk:
            await asyncio.sleep(WARMUP_S)
        start = loop.time()
        window = (start, start + seconds)
        dues = schedule(len(requests), seconds, rate, seed)
        await asyncio.gather(*(query(start + due, requests[i]) for due, i in dues))
    finally:
        stopping.set()
        await asyncio.gather(*clients)
        for connection in pool:
            connection.close()
    answered = sum(1 for t in bulk_answers if window[0] <= t <= window[1])
    return {
        "bulk_clients": bulk,
        "bulk_inputs": BULK_INPUTS,
        "seconds": seconds,
        "rate": rate,
        "queries": len(dues),
        "answered": len(latencies),
        "latency_ms": latency_summary(latencies),
        "bulk_texts_per_s": answered * BULK_INPUTS / seconds if bulk else None,
        "errors": dict(errors),
    }


def failure(mix: dict[str, Any]) -> str | None:
    """Why one measurement of `measure` is no result, or None: no query answered (its latencies are zeros), or bulk
    clients whose every request failed, so that the queries ran alone whatever the count of bulk clients says.
    Some refusals among answers are figures of the run, counted in its errors."""
    errors = ", ".join(f"{kind} {n}" for kind, n in mix["errors"].items())
    if mix["queries"] and not mix["answered"]:
        return f"no query was answered ({errors})"
    bulk_errors = {kind: n for kind, n in mix["errors"].items() if kind.startswith("bulk: ")}
    if mix["bulk_clients"] and bulk_errors and not mix["bulk_texts_per_s"]:
        return f"every bulk request failed ({', '.join(f'{kind} {n}' for kind, n in bulk_errors.items())})"
    return None
