"""The bench's HTTP/1.1 client against a scripted server: framing, keep-alive, reconnection, refusals."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from mhaserve.loadtest.bench.transports import CallFailed, HttpConnection, HttpTransport, http_requests
from mhaserve.loadtest.bench.workloads import Workload

OK = orjson.dumps({"object": "list", "data": [{"index": 0, "embedding": [0.5]}], "usage": {"prompt_tokens": 7}})
# One answer per request, in order: by Content-Length, in chunks, then one that closes the connection,
# then a refusal (on the connection the client has to open again).
ANSWERS = [
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(OK), OK),
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n"
    % (10, OK[:10], len(OK) - 10, OK[10:]),
    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(OK), OK),
    b'HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: 11\r\n\r\n{"error":1}',
]


class Scripted:
    """Reads whole requests (by Content-Length) and answers them from ANSWERS."""

    def __init__(self) -> None:
        self.connections = 0
        self.bodies: list[bytes] = []
        self.answers = iter(ANSWERS)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
            )
            self.bodies.append(await reader.readexactly(length))
            answer = next(self.answers)
            writer.write(answer)
            await writer.drain()
            if b"Connection: close" in answer:
                break
        writer.close()


def _workload() -> Workload:
    texts = ["how to make pancakes", 'a "quoted" text, with ünïcode']
    return Workload("short", "test", "texts", [[101, 1, 102], [101, 2, 102]], texts)


def test_requests_are_whole_and_ask_for_the_encoding() -> None:
    raw = http_requests(_workload(), "127.0.0.1:8080", "base64")
    head, body = raw[1].split(b"\r\n\r\n", 1)
    assert head.startswith(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n")
    assert f"Content-Length: {len(body)}".encode() in head
    sent = orjson.loads(body)
    assert sent == {"input": _workload().texts[1], "encoding_format": "base64", "truncate": True}
    ids = http_requests(Workload("fixed", "test", "ids", [[101, 5, 102]]), "h:1", "float")
    assert orjson.loads(ids[0].split(b"\r\n\r\n", 1)[1])["input"] == [101, 5, 102]


def test_keep_alive_chunks_reconnection_and_refusals() -> None:
    async def main() -> None:
        scripted = Scripted()
        server = await asyncio.start_server(scripted.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        link = HttpTransport(f"http://127.0.0.1:{port}", _workload(), "float")
        async with server, link:
            send = link.client()
            assert [await send(0), await send(1), await send(0)] == [7, 7, 7]
            assert scripted.connections == 1  # the first three on one kept-alive connection
            with pytest.raises(CallFailed) as refused:
                await send(1)
            assert refused.value.key == "HTTP 429"
            assert scripted.connections == 2  # the server closed after the third: opened again
        assert [orjson.loads(b)["input"] for b in scripted.bodies] == [_workload().texts[i] for i in (0, 1, 0, 1)]

    asyncio.run(main())


def test_a_connection_that_cannot_be_made_is_a_counted_failure() -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        link = HttpTransport(f"http://127.0.0.1:{port}", _workload(), "float")
        async with link:
            with pytest.raises(CallFailed, match="connection: ConnectionRefusedError"):
                await link.client()(0)

    asyncio.run(main())


def test_only_plain_http_urls() -> None:
    with pytest.raises(ValueError, match="http://host:port"):
        HttpTransport("https://127.0.0.1:8443", _workload(), "float")
    with pytest.raises(ValueError, match="unknown protocol"):
        from mhaserve.loadtest.bench.transports import transport

        transport("websocket", "127.0.0.1:1", "http://127.0.0.1:2", _workload())


def test_connection_reads_a_body_delimited_by_close() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
        await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        connection = HttpConnection("127.0.0.1", server.sockets[0].getsockname()[1])
        async with server:
            assert await connection.request(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == (200, b"until the end")
            assert connection.writer is None  # closed: the next request opens a new one

    asyncio.run(main())


def test_a_connection_the_server_closed_while_idle_is_opened_again() -> None:
    """The server closes a keep-alive connection idle past its timeout (ours: 5 s) without a word; the next
    request on it went out and failed (IncompleteReadError) where an HTTP client's pool opens another."""
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")  # keep-alive, as far as the client knows
        await writer.drain()
        writer.close()  # then closed while idle

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        connection = HttpConnection("127.0.0.1", server.sockets[0].getsockname()[1])
        async with server:
            for _ in range(2):
                assert await connection.request(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == (200, b"ok")
                await asyncio.sleep(0.1)  # idle: the server's FIN arrives
            assert connections == 2
            connection.close()

    asyncio.run(main())
