"""A raw HTTP/2 client for the tests that send what no gRPC client would (floods, limits, broken frames), on
either gRPC front: the frames are service/rpc/lean/frames.py's."""

from __future__ import annotations

import contextlib
import socket
import urllib.parse
from collections.abc import Callable

import hpack

from mhaserve.service.rpc.lean import frames as f

Frame = tuple[int, int, int, bytes]  # type, flags, stream id, payload


def call_block(path: str, *extra: tuple[str, str | bytes]) -> bytes:
    """The header block of a gRPC call to `path`, as a client sends it, with `extra` fields after (a
    `grpc-timeout`, metadata)."""
    return f.header_block(
        (
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *extra,
        )
    )


def raw_exchange(
    port: int, frames: bytes, until_closed: bool = True, until: Callable[[list[Frame]], bool] | None = None
) -> list[Frame]:
    """Send the preface, an empty SETTINGS and `frames`; the frames the server sends back, until it closes
    the connection (or, with `until_closed` False, until it stays silent for half a second, once `until` says so
    of what it has sent when given: a busy machine can keep a server silent that long before its first answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(f.PREFACE + f.settings() + frames)
        return read_frames(raw, 10 if until_closed else 0.5, until)


def read_frames(raw: socket.socket, quiet: float, until: Callable[[list[Frame]], bool] | None = None) -> list[Frame]:
    """The frames the server sends until it closes the connection or stays silent for `quiet` seconds (for 10
    seconds, before `until` says so of them)."""
    raw.settimeout(quiet if until is None else 10)
    got: list[Frame] = []
    buf = bytearray()
    with contextlib.suppress(TimeoutError):
        while chunk := raw.recv(65536):
            buf += chunk
            got += f.whole_frames(buf)
            if until is not None and until(got):
                raw.settimeout(quiet)
                until = None
    return got


def read_until(raw: socket.socket, done: Callable[[list[Frame]], bool]) -> list[Frame]:
    """The frames the server sends until `done` says so of them (10 s at most, or the connection's end)."""
    got: list[Frame] = []
    buf = bytearray()
    raw.settimeout(10)
    while not done(got):
        chunk = raw.recv(65536)
        if not chunk:
            break
        buf += chunk
        got += f.whole_frames(buf)
    return got


def answered(*streams: int) -> Callable[[list[Frame]], bool]:
    """An `until` for raw_exchange: the server has ended each of `streams` (a HEADERS that ends it, or
    RST_STREAM), or sent a GOAWAY."""

    def done(frames: list[Frame]) -> bool:
        ends = [
            (sid, kind == f.RST_STREAM or (kind == f.HEADERS and flags & f.END_STREAM))
            for kind, flags, sid, _ in frames
        ]
        ended = {sid for sid, end in ends if end}
        return set(streams) <= ended or any(kind == f.GOAWAY for kind, _, _, _ in frames)

    return done


def goaway_streams(frames: list[Frame]) -> list[int]:
    """The last stream each GOAWAY among `frames` names."""
    return [int.from_bytes(payload[:4], "big") & 0x7FFFFFFF for kind, _, _, payload in frames if kind == f.GOAWAY]


def goaway_code(frames: list[Frame]) -> int | None:
    codes = [int.from_bytes(payload[4:8], "big") for kind, _, _, payload in frames if kind == f.GOAWAY]
    return codes[-1] if codes else None


def goaway_debug(frames: list[Frame]) -> bytes | None:
    debug = [payload[8:] for kind, _, _, payload in frames if kind == f.GOAWAY]
    return debug[-1] if debug else None


def answers(frames: list[Frame]) -> dict[int, dict[str, str]]:
    """The fields of the HEADERS that ended each stream (its trailers, or its whole answer), by stream."""
    decoder = hpack.Decoder()
    ended = {}
    for kind, flags, sid, payload in frames:
        if kind == f.HEADERS:
            fields = {str(k): urllib.parse.unquote(str(v)) for k, v in decoder.decode(payload)}
            if flags & f.END_STREAM:
                ended[sid] = fields
    return ended
