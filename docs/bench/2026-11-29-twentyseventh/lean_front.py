"""What would a gRPC front outside grpcio's Python bindings cost a call? An upper bound, measured.

docs/benchmarks.md names "a gRPC layer outside grpcio's Python bindings" as what would move the two targets
of issue 18 that gRPC misses on the fastest CPUs. This script measures how cheap such a layer can be in
Python at best: `lean`, a minimal HTTP/2 server for unary gRPC calls on an asyncio Protocol (preface,
SETTINGS, PING, WINDOW_UPDATE, HEADERS and CONTINUATION decoded with the `hpack` package, DATA; the answer's
headers, message and trailers in one write, from bytes made once), against grpc.aio's server, each answering
one empty method with 1,600 bytes (about 384 float32 in protobuf), as grpc_options.py (fifteenth session) did.
`lean-task` answers from an asyncio task per call, as a real handler that awaits the batcher would.

It is not a server to ship (no TLS, no deadlines, no compression, no metadata for the handler, no GOAWAY
on shutdown, the stream windows trusted), only the floor under any Python front with this design.
The clients are the bench's: grpc.aio, every client on one channel. Each server is started afresh for each
configuration, in alternated rounds: 32 closed-loop clients for SECONDS (the server's CPU a call, from
/proc; the load generator's, from getrusage; calls a second), then one client for 2 s (its p50).

The server's own lean front (service/rpc/lean, `--grpc-front lean`) grew from this script; `hpack` comes with
the server's install (HPACK_PATH, if set, is put on the server's path: how the script first ran). Run from the
repository root:
    python docs/bench/2026-11-29-twentyseventh/lean_front.py ROUNDS SECONDS [CONFIG ...]
"""

from __future__ import annotations

import asyncio
import os
import resource
import statistics
import struct
import subprocess
import sys
import time

ANSWER = b"x" * 1600
CONFIGS = ("grpc-aio", "lean", "lean-task")
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
BIG_WINDOW = (1 << 31) - 1


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


# The answer's header blocks, without indexing (so no state in either side's HPACK table): `:status: 200`
# (static index 8), `content-type: application/grpc` (its name at static index 31), and the trailers'
# `grpc-status: 0` (a new name).
RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + bytes([16]) + b"application/grpc"
TRAILERS = b"\x00" + bytes([11]) + b"grpc-status" + b"\x01" + b"0"


def answer(stream: int, message: bytes) -> bytes:
    body = b"\x00" + struct.pack(">I", len(message)) + message
    return (
        frame(HEADERS, END_HEADERS, stream, RESPONSE_HEADERS)
        + frame(DATA, 0, stream, body)
        + frame(HEADERS, END_HEADERS | END_STREAM, stream, TRAILERS)
    )


class LeanH2(asyncio.Protocol):
    """One HTTP/2 connection that answers every unary gRPC call with ANSWER."""

    def __init__(self, in_task: bool) -> None:
        import hpack  # type: ignore[import-not-found]

        self.decoder = hpack.Decoder()
        self.in_task = in_task
        self.buffer = bytearray()
        self.preface = False
        self.streams: dict[int, bytearray] = {}
        self.paths: dict[int, str] = {}
        self.block: tuple[int, int, bytearray] | None = None  # stream, flags, a header block awaiting CONTINUATION
        self.send_window = 65535
        self.pending: list[bytes] = []
        self.received = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        # Our SETTINGS: a large stream window (id 4), then the connection's window raised to match.
        self.transport.write(
            frame(SETTINGS, 0, 0, struct.pack(">HI", 4, BIG_WINDOW))
            + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", BIG_WINDOW - 65535))
        )

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        if not self.preface:
            if len(buf) < len(PREFACE):
                return
            assert bytes(buf[: len(PREFACE)]) == PREFACE, "not an HTTP/2 client"
            del buf[: len(PREFACE)]
            self.preface = True
        at, out = 0, []
        while len(buf) - at >= 9:
            length = int.from_bytes(buf[at : at + 3], "big")
            if len(buf) - at < 9 + length:
                break
            kind, flags = buf[at + 3], buf[at + 4]
            stream = int.from_bytes(buf[at + 5 : at + 9], "big") & 0x7FFFFFFF
            payload = bytes(buf[at + 9 : at + 9 + length])
            at += 9 + length
            self.frame(kind, flags, stream, payload, out)
        del buf[:at]
        if out:
            self.transport.write(b"".join(out))

    def frame(self, kind: int, flags: int, stream: int, payload: bytes, out: list[bytes]) -> None:
        if kind == DATA:
            self.received += len(payload)
            if flags & PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            self.streams[stream] += payload
            if flags & END_STREAM:
                self.call(stream, out)
            if self.received > BIG_WINDOW // 2:  # give the connection's window back in one large step
                out.append(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.received)))
                self.received = 0
        elif kind == HEADERS:
            if flags & PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            if flags & PRIORITY:
                payload = payload[5:]
            self.block = (stream, flags, bytearray(payload))
            if flags & END_HEADERS:
                self.headers_done(out)
        elif kind == CONTINUATION:
            assert self.block is not None and self.block[0] == stream
            self.block[2].extend(payload)
            if flags & END_HEADERS:
                self.headers_done(out)
        elif kind == SETTINGS:
            if not flags & ACK:
                out.append(frame(SETTINGS, ACK, 0, b""))
        elif kind == PING:
            if not flags & ACK:
                out.append(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            if stream == 0:
                self.send_window += int.from_bytes(payload, "big") & 0x7FFFFFFF
                waiting, self.pending = self.pending, []
                for chunk in waiting:
                    self.send(chunk, out)
        elif kind == RST_STREAM:
            self.streams.pop(stream, None)
        elif kind == GOAWAY:
            self.transport.close()

    def headers_done(self, out: list[bytes]) -> None:
        assert self.block is not None
        stream, flags, block = self.block
        self.block = None
        headers = self.decoder.decode(bytes(block))
        self.paths[stream] = next(v for k, v in headers if k == ":path")
        self.streams[stream] = bytearray()
        if flags & END_STREAM:
            self.call(stream, out)

    def call(self, stream: int, out: list[bytes]) -> None:
        body = self.streams.pop(stream)
        self.paths.pop(stream)
        size = int.from_bytes(body[1:5], "big")
        assert body[0] == 0 and len(body) == 5 + size, "a compressed or partial gRPC message"
        if self.in_task:
            asyncio.get_running_loop().create_task(self.answer_later(stream))
        else:
            self.send(answer(stream, ANSWER), out)

    async def answer_later(self, stream: int) -> None:
        out: list[bytes] = []
        self.send(answer(stream, ANSWER), out)
        if out:
            self.transport.write(out[0])

    def send(self, chunk: bytes, out: list[bytes]) -> None:
        """An answer into `out`, or held back until the peer's connection window has room for its DATA."""
        need = len(ANSWER) + 5
        if need > self.send_window:
            self.pending.append(chunk)
            return
        self.send_window -= need
        out.append(chunk)


def serve(config: str, port: int) -> None:
    async def main() -> None:
        if config == "grpc-aio":
            import grpc

            async def same(_request: bytes, _context: object) -> bytes:
                return ANSWER

            handler = grpc.method_handlers_generic_handler("x.X", {"Do": grpc.unary_unary_rpc_method_handler(same)})
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((handler,))
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            await server.wait_for_termination()
        else:
            loop = asyncio.get_running_loop()
            lean = await loop.create_server(lambda: LeanH2(config == "lean-task"), "127.0.0.1", port)
            await lean.serve_forever()

    asyncio.run(main())


async def load(port: int, clients: int, seconds: float) -> tuple[int, float, float]:
    """(calls, seconds, p50 seconds) of `clients` closed-loop grpc.aio clients on one channel."""
    import grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary("/x.X/Do")
    for _ in range(200):
        assert await call(b"y" * 200, timeout=10) == ANSWER
    stop = time.perf_counter() + seconds
    latencies: list[float] = []

    async def user() -> int:
        n = 0
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            await call(b"y" * 200, timeout=120)
            latencies.append(time.perf_counter() - t0)
            n += 1
        return n

    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*(user() for _ in range(clients))))
    elapsed = time.perf_counter() - t0
    await channel.close()
    return n, elapsed, statistics.median(latencies)


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(rounds: int, seconds: float, configs: list[str]) -> None:
    from mhaserve.loadtest.bench.quiet import process_cpu_seconds
    from mhaserve.testing.loopback import free_port

    env = dict(os.environ)
    if "HPACK_PATH" in env:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env["HPACK_PATH"], env.get("PYTHONPATH")) if p)
    results: dict[str, list[tuple[float, float, float, float]]] = {c: [] for c in configs}
    for r in range(rounds):
        for config in configs if r % 2 == 0 else configs[::-1]:
            port = free_port()
            server = subprocess.Popen([sys.executable, __file__, "serve", config, str(port)], env=env)
            time.sleep(1.5)
            asyncio.run(load(port, 32, 1))
            c0, own0 = process_cpu_seconds(server.pid) or 0.0, own_cpu()
            n, elapsed, _ = asyncio.run(load(port, 32, seconds))
            cpu_us = ((process_cpu_seconds(server.pid) or 0.0) - c0) / n * 1e6
            client_us = (own_cpu() - own0) / n * 1e6
            _, _, p50 = asyncio.run(load(port, 1, 2))
            server.kill()
            server.wait()
            results[config].append((cpu_us, client_us, n / elapsed, p50 * 1e3))
            print(f"round {r} {config:9s} 32 clients: {n / elapsed:6.0f} calls/s, server CPU {cpu_us:4.0f} us a call, "
                  f"load generator {client_us:4.0f} us; 1 client p50 {p50 * 1e3:.3f} ms", flush=True)  # fmt: skip
    for config, rows in results.items():
        cpu, client, rate, p50 = (statistics.median(row[i] for row in rows) for i in range(4))
        print(f"{config:9s} medians: server CPU {cpu:.0f} us a call, load generator {client:.0f} us, "
              f"{rate:.0f} calls/s, 1 client p50 {p50:.3f} ms")  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:] or list(CONFIGS))
