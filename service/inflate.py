"""Compressed requests, inflated within the size limit: HTTP bodies (`Content-Encoding`) and gRPC messages
(`grpc-encoding`, on the lean front; grpc core inflates grpc.aio's).

Inflating stops one byte past the limit instead of running to the end and measuring: a gzip of zeros
inflates about 1,000-fold, so a request well under the limit can hold gigabytes (a 61 KB message inflated
to 60 MiB took 120 MiB of the lean front's memory before it was refused, 2026-12-01).
"""

from __future__ import annotations

import re
import zlib

from mhaserve.runtime.errors import InvalidArgument

KINDS = ("gzip", "deflate")

# The input is fed a piece at a time, so that what zlib copies after a member's end (its unused_data) is a piece,
# not the rest of the input: fed whole, each member copied what followed it, and 200,000 empty members (4 MB)
# held the event loop 9 s. Multi-member gzip is rare (`cat a.gz b.gz`, bgzip's blocks of 64 KiB); the members'
# count is bounded all the same, each costing a few microseconds of Python.
PIECE = 64 << 10
MAX_MEMBERS = 1024
_NOT_ZERO = re.compile(rb"[^\x00]")


def inflate(data: bytes, kind: str, limit: int, what: str) -> bytes:
    """`data` inflated (`kind`: gzip, every member of it, as gzip.decompress reads them; or deflate, zlib's
    format, as HTTP and gRPC name it), at most `limit` + 1 bytes of it: longer means over the limit, which
    the caller words. A stream that does not inflate, is cut short, or has bytes after its end (zeros after
    a gzip member are padding that gzip's tools write) is InvalidArgument, never served as far as it went,
    and so is gzip of more than MAX_MEMBERS members; `what` names it in the message ("the gzip body")."""
    out = bytearray()
    view = memoryview(data)
    at = members = 0
    while True:
        if members == MAX_MEMBERS:
            raise InvalidArgument(f"{what} has more than {MAX_MEMBERS} gzip members; send one")
        members += 1
        inflater = zlib.decompressobj(zlib.MAX_WBITS | 16 if kind == "gzip" else zlib.MAX_WBITS)
        while not inflater.eof:
            if at >= len(data):
                raise InvalidArgument(f"{what} is cut short")
            piece = view[at : at + PIECE]
            try:
                out += inflater.decompress(piece, limit + 1 - len(out))
            except zlib.error as e:
                raise InvalidArgument(f"{what} does not inflate: {e}") from None
            if len(out) > limit:
                return bytes(out)
            at += len(piece) - len(inflater.unused_data)  # (the piece read whole but what follows the end)
        after = _NOT_ZERO.search(data, at)
        if after is None:
            return bytes(out)
        if kind != "gzip":
            raise InvalidArgument(f"{len(data) - after.start()} bytes after the end of {what}")
        at = after.start()
