"""Queries beside bulk clients (the bench's beside.py) against a scripted HTTP server: what each client sends,
how a query is timed, and refusals counted rather than raised."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from mhaserve.loadtest.bench import beside

TEXTS = [f"text number {i}" for i in range(100)]
DELAY_S = 0.02


class Scripted:
    """Answers each `POST /v1/embeddings` after `delay` with one embedding an input, or with `status`."""

    def __init__(self, status: int = 200, delay: float = DELAY_S) -> None:
        self.status, self.delay = status, delay
        self.bodies: list[dict[str, Any]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            body = orjson.loads(await reader.readexactly(length))
            self.bodies.append(body)
            await asyncio.sleep(self.delay)
            if self.status == 200:
                data = [{"index": i, "embedding": "AAAAAA=="} for i in range(len(body["input"]))]
                answer = orjson.dumps({"data": data, "usage": {"prompt_tokens": 1}})
            else:
                answer = b'{"error": {"message": "no"}}'
            writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (self.status, len(answer), answer))
            await writer.drain()
        writer.close()


def served(server: Scripted, measure: Callable[[str], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        port = listening.sockets[0].getsockname()[1]
        async with listening:
            return await measure(f"http://127.0.0.1:{port}")

    return asyncio.run(asyncio.wait_for(main(), 60))


def test_queries_beside_a_bulk_client_are_timed_from_when_they_were_due() -> None:
    server = Scripted()
    got = served(server, lambda url: beside.measure(url, TEXTS, 1, 0.6, 30.0, seed=1))
    assert got["errors"] == {} and got["answered"] == got["queries"] > 5
    assert got["latency_ms"]["p50"] >= DELAY_S * 1000  # never less than the server took
    # The bulk client's requests, answered in the window, 64 texts each, back to back.
    assert got["bulk_texts_per_s"] > 0 and round(got["bulk_texts_per_s"] * 0.6) % beside.BULK_INPUTS == 0
    sizes = [len(b["input"]) for b in server.bodies]
    assert sorted(set(sizes)) == [1, beside.BULK_INPUTS] and sizes.count(1) == got["queries"]
    assert all(b["encoding_format"] == "base64" and b["truncate"] is True for b in server.bodies)
    assert {t for b in server.bodies for t in b["input"]} <= set(TEXTS)


def test_queries_alone_have_no_bulk_figure() -> None:
    server = Scripted()
    got = served(server, lambda url: beside.measure(url, TEXTS, 0, 0.3, 30.0, seed=2))
    assert got["bulk_texts_per_s"] is None and got["answered"] == got["queries"] > 0
    assert all(len(b["input"]) == 1 for b in server.bodies)
    # The texts of the schedule the in-process replay is given (inprocess.py), in its order.
    assert [b["input"][0] for b in server.bodies] == [TEXTS[i] for _, i in beside.schedule(len(TEXTS), 0.3, 30.0, 2)]


def test_refusals_are_counted_by_client_and_kind_not_raised() -> None:
    got = served(Scripted(status=429), lambda url: beside.measure(url, TEXTS, 1, 0.3, 30.0, seed=3))
    assert got["answered"] == 0 and got["errors"]["query: HTTP 429"] == got["queries"] > 0
    assert got["errors"]["bulk: HTTP 429"] >= 1 and got["bulk_texts_per_s"] == 0
