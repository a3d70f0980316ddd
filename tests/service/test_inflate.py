"""Compressed requests inflated within the limit (service/inflate.py): what HTTP bodies and the lean gRPC
front's messages go through."""

from __future__ import annotations

import gzip
import tracemalloc
import zlib

import pytest

from mhaserve.runtime.errors import InvalidArgument
from mhaserve.service.inflate import inflate

TEXT = b"a body worth compressing " * 40


def test_gzip_members_and_padding_are_read_whole_and_deflate_is_zlibs_format() -> None:
    members = gzip.compress(TEXT[:100]) + gzip.compress(TEXT[100:])
    assert inflate(members, "gzip", 1 << 20, "it") == TEXT
    assert inflate(gzip.compress(TEXT) + bytes(8), "gzip", 1 << 20, "it") == TEXT
    assert inflate(zlib.compress(TEXT), "deflate", 1 << 20, "it") == TEXT


@pytest.mark.parametrize(
    ("data", "kind", "message"),
    [
        (gzip.compress(TEXT)[:-9], "gzip", "the body is cut short"),
        (gzip.compress(TEXT) + b"garbage", "gzip", "the body does not inflate"),
        (zlib.compress(TEXT) + b"garbage", "deflate", "7 bytes after the end of the body"),
        (b"plain", "gzip", "the body does not inflate"),
    ],
)
def test_a_stream_that_does_not_inflate_whole_is_refused(data: bytes, kind: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        inflate(data, kind, 1 << 20, "the body")


@pytest.mark.parametrize("kind", ["gzip", "deflate"])
def test_inflating_stops_a_byte_past_the_limit(kind: str) -> None:
    """A bomb (64 MiB of zeros in 64 KB) is inflated no further than the limit and a byte, whichever member
    holds it: the memory it took stays near the limit, not near what it would inflate to."""
    zeros = bytes(64 << 20)
    bomb = gzip.compress(zeros, 9) if kind == "gzip" else zlib.compress(zeros, 9)
    if kind == "gzip":
        bomb = gzip.compress(b"x" * 1000) + bomb  # past the limit in the second member
    del zeros
    limit = 1 << 20
    tracemalloc.start()
    try:
        out = inflate(bomb, kind, limit, "it")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(out) == limit + 1
    assert peak < 4 * limit, peak
    whole = inflate(bomb, kind, 65 << 20, "it")  # under a limit it does not pass, read whole
    assert len(whole) == (1000 if kind == "gzip" else 0) + (64 << 20) and not any(whole[-(64 << 20) :])


def test_gzip_of_many_members_is_read_up_to_a_bound() -> None:
    """bgzip writes a member every 64 KiB: read, as gzip.decompress reads them; past 1,024 members, refused."""
    parts = [gzip.compress(bytes([i % 251]) * 70_000) for i in range(100)]  # each member's end past a piece
    many = b"".join(parts)
    assert inflate(many, "gzip", 100 << 20, "it") == gzip.decompress(many)
    padded = many + bytes(100)  # zeros after the last member: padding gzip's tools write
    assert inflate(padded, "gzip", 100 << 20, "it") == gzip.decompress(many)
    with pytest.raises(InvalidArgument, match="^the gzip body has more than 1024 gzip members; send one$"):
        inflate(gzip.compress(b"x") * 1025, "gzip", 1 << 20, "the gzip body")
    assert inflate(gzip.compress(b"x") * 1024, "gzip", 1 << 20, "it") == b"x" * 1024


def test_a_body_of_many_empty_gzip_members_is_refused_without_reading_them_all() -> None:
    """Each member after the first copied what was left of the body: 200,000 empty members (4 MB) took 9 s of
    the event loop as every one was read. Now a member copies at most a piece of the body, and the 1,025th is
    refused."""
    with pytest.raises(InvalidArgument, match="^the gzip body has more than 1024 gzip members; send one$"):
        inflate(gzip.compress(b"") * 200_000, "gzip", 1 << 20, "the gzip body")
