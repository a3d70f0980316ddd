"""How the bench's simulated clients reach the server: encoder.v1 over gRPC, or OpenAI embeddings over HTTP.

All are asyncio, in the bench's one event loop, and meant to cost the load generator little a request, since on
a small machine what they take is taken from the server:

- gRPC: grpc.aio, every client on one channel (HTTP/2 streams), as before; or, with `--grpc-client h2`, the
  bench's own HTTP/2 client (h2client.py), as small a client as the HTTP one: grpc.aio's costs the load
  generator twice the CPU a request that the HTTP client does.
- gRPC from a synchronous stub (`GrpcSyncClient`): one client only, outside the event loop, to tell a
  lone call's client side from the server's. grpc.aio's client runs its own event loop, which grpc's poller
  thread wakes on each call; the synchronous stub blocks in grpc core instead, as `mhaserve encode` and most
  Python callers do. (On the 2-core VM the two read alike: docs/benchmarks.md, twelfth session.) Several of
  them would need a thread each and measure the GIL between those threads, so the closed loops of many
  clients stay on grpc.aio.
- HTTP: a small HTTP/1.1 client over `asyncio.open_connection`, one keep-alive connection per client
  (what an OpenAI client with a connection pool does under a closed loop). Each request is built once,
  whole (request line, headers and JSON body), before the run; a response is read by its
  Content-Length (or chunks) and its JSON parsed with orjson. No HTTP library sits in between: an
  aiohttp or httpx client costs several times more CPU per request, which a 2-core machine takes from
  the server.

A transport gives each client a `send(i)`: send request i, wait for its answer, return the tokens the
server counted; a refusal or a broken connection raises `CallFailed`, named as the report counts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, Self
from urllib.parse import urlsplit

import grpc
import grpc.aio
import orjson

from mhaserve.loadtest.bench.h2client import GrpcH2Transport
from mhaserve.loadtest.bench.workloads import Workload
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service.client import CHANNEL_OPTIONS

Send = Callable[[int], Awaitable[int]]
TIMEOUT_S = 120.0
ROUTE = "/v1/embeddings"
# protocol name -> the OpenAI `encoding_format` it asks for
HTTP_ENCODINGS = {"http": "float", "http-base64": "base64"}


class Transport(Protocol):
    """Opened with `async with`; `client()` is one simulated client's `send`."""

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc: object) -> None: ...

    def client(self) -> Send: ...


class CallFailed(Exception):
    """A request that got no embedding: `key` is how the report counts it (a gRPC status, `HTTP 429`, ...)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def grpc_requests(workload: Workload, model: str = "") -> list[pb.EncodeRequest]:
    """Each input as one `Encode` request, for `model` (the server's default model when empty)."""
    if workload.payload == "ids":
        return [pb.EncodeRequest(token_ids=[pb.TokenIds(ids=s)], truncate=True, model=model) for s in workload.ids]
    return [pb.EncodeRequest(texts=[t], truncate=True, model=model) for t in workload.texts]


def http_request(host: str, value: Any, encoding_format: str, model: str = "") -> bytes:
    """A whole `POST /v1/embeddings` request (request line, headers and JSON body) for the input `value`: a
    text, a list of texts, or a list of token ids."""
    fields = {"input": value, "encoding_format": encoding_format, "truncate": True}
    body = orjson.dumps(fields | ({"model": model} if model else {}))
    head = (
        f"POST {ROUTE} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body


def http_requests(workload: Workload, host: str, encoding_format: str, model: str = "") -> list[bytes]:
    """Each input as a whole `POST /v1/embeddings` request: one text, or one list of token ids."""
    inputs: list[Any] = list(workload.ids) if workload.payload == "ids" else list(workload.texts)
    return [http_request(host, value, encoding_format, model) for value in inputs]


class GrpcTransport:
    """encoder.v1 `Encode`, every client on one grpc.aio channel, or with `own_channels` each client on a
    channel (a connection) of its own: a server of several processes (`--processes`) gets connections,
    not calls, spread over its processes, and one channel is one connection."""

    def __init__(self, address: str, workload: Workload, model: str = "", *, own_channels: bool = False) -> None:
        self.address = address
        self.requests = grpc_requests(workload, model)
        self.own_channels = own_channels
        self.channel: grpc.aio.Channel | None = None
        self.channels: list[grpc.aio.Channel] = []

    async def __aenter__(self) -> GrpcTransport:
        if not self.own_channels:
            self.channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            await self.channel.channel_ready()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for channel in [self.channel, *self.channels]:
            if channel is not None:
                await channel.close()

    def client(self) -> Send:
        if self.own_channels:
            # Without a local subchannel pool, grpc shares one connection among channels to the same target.
            channel = grpc.aio.insecure_channel(
                self.address, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
            )
            self.channels.append(channel)
        else:
            assert self.channel is not None
            channel = self.channel
        stub = pb_grpc.EncoderServiceStub(channel)
        requests = self.requests

        async def send(i: int) -> int:
            try:
                response = await stub.Encode(requests[i], timeout=TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                raise CallFailed(e.code().name) from None
            return int(response.usage.input_tokens)

        return send


class GrpcSyncClient:
    """encoder.v1 `Encode` from grpcio's synchronous stub on a channel of its own, one call at a time; closed
    with `with`."""

    def __init__(self, address: str, workload: Workload, model: str = "") -> None:
        self.requests = grpc_requests(workload, model)
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.EncoderServiceStub(self.channel)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()

    def send(self, i: int) -> int:
        """Send request i and wait for its answer; the tokens the server counted."""
        try:
            response = self.stub.Encode(self.requests[i], timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            raise CallFailed(e.code().name) from None
        return int(response.usage.input_tokens)


class HttpConnection:
    """One HTTP/1.1 connection, one request at a time, kept alive; opened again when the server closes it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        """Send one whole request; the response's status and body."""
        if self.reader is not None and self.reader.at_eof():
            # The server closed it while it was idle (its keep-alive timeout, 5 s for ours): a request sent on
            # it would fail; an HTTP client's pool opens another, as here.
            self.close()
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        if "content-length" in headers:
            body = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            body = await self._chunks()
        else:  # delimited by the end of the connection
            body = await self.reader.read()
            headers["connection"] = "close"
        if headers.get("connection") == "close":
            self.close()
        return status, body

    async def _chunks(self) -> bytes:
        assert self.reader is not None
        parts: list[bytes] = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")  # no trailers are expected: the empty line
                return b"".join(parts)
            parts.append(await self.reader.readexactly(size))
            await self.reader.readexactly(2)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def call(connection: HttpConnection, raw: bytes, inputs: int) -> Any:
    """Send one whole request on `connection` and check its answer holds `inputs` embeddings: the answer's JSON.
    A refusal, a timeout or a broken connection (closed then) raises CallFailed, named as the report counts it."""
    try:
        async with asyncio.timeout(TIMEOUT_S):
            status, body = await connection.request(raw)
    except TimeoutError:  # before OSError, of which it is a subclass
        connection.close()
        raise CallFailed("timeout") from None
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
        connection.close()
        raise CallFailed(f"connection: {type(e).__name__}") from None
    if status != 200:
        raise CallFailed(f"HTTP {status}")
    answer = orjson.loads(body)
    if len(answer["data"]) != inputs:
        raise CallFailed(f"{len(answer['data'])} embeddings for {inputs} input(s)")
    return answer


def http_address(url: str) -> tuple[str, int, str]:
    """A plain http://host:port URL's host, port and `Host` header (netloc); ValueError for anything else."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None or parts.port is None:
        raise ValueError(f"expected http://host:port, got {url!r}")
    return parts.hostname, parts.port, parts.netloc


class HttpTransport:
    """OpenAI `POST /v1/embeddings`, one keep-alive connection per client."""

    def __init__(self, url: str, workload: Workload, encoding_format: str, model: str = "") -> None:
        self.host, self.port, netloc = http_address(url)
        self.requests = http_requests(workload, netloc, encoding_format, model)
        self.connections: list[HttpConnection] = []

    async def __aenter__(self) -> HttpTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for c in self.connections:
            c.close()

    def client(self) -> Send:
        connection = HttpConnection(self.host, self.port)
        self.connections.append(connection)
        requests = self.requests

        async def send(i: int) -> int:
            answer = await call(connection, requests[i], 1)
            return int(answer["usage"]["prompt_tokens"])

        return send


def transport(
    protocol: str,
    grpc_address: str,
    http_url: str,
    workload: Workload,
    model: str = "",
    *,
    own_channels: bool = False,
    grpc_client: str = "aio",
) -> Transport:
    """The transport of a protocol name (grpc, http, http-base64), ready for `async with`; its requests name
    `model` (none when empty: the server's default model); `own_channels`: a gRPC channel per client
    (HTTP clients always hold a connection each); `grpc_client`: grpc.aio's client (aio) or the bench's own
    HTTP/2 client (h2, h2client.py)."""
    if protocol == "grpc" and grpc_client == "h2":
        return GrpcH2Transport(
            grpc_address, workload, grpc_requests(workload, model), TIMEOUT_S, CallFailed, own_channels=own_channels
        )
    if protocol == "grpc":
        return GrpcTransport(grpc_address, workload, model, own_channels=own_channels)
    if protocol in HTTP_ENCODINGS:
        return HttpTransport(http_url, workload, HTTP_ENCODINGS[protocol], model)
    raise ValueError(f"unknown protocol {protocol!r}")
