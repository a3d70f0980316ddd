"""Compressed requests, inflated within the size limit: HTTP bodies (`Content-Encoding`) and gRPC messages
(`grpc-encoding`, on the lean front; grpc core inflates grpc.aio's).

Inflating stops one byte past the limit instead of running to the end and measuring: a gzip of zeros
inflates about 1,000-fold, so a request well under the limit can hold gigabytes (a 61 KB message inflated
to 60 MiB took 120 MiB of the lean front's memory before it was refused, 2026-12-01).
"""

from __future__ import annotations

import zlib

from mhaserve.runtime.errors import InvalidArgument

KINDS = ("gzip", "deflate")

# Each member after the first copies what is left of the input (zlib's unused_data), so reading members
# without a bound is quadratic: 200,000 empty members (4 MB) held the event loop 9 s. Bodies and messages
# hold one member in practice (`cat a.gz b.gz` makes two); 16 bounds the copying to 16 times the input.
MAX_MEMBERS = 16


def inflate(data: bytes, kind: str, limit: int, what: str) -> bytes:
    """`data` inflated (`kind`: gzip, every member of it, as gzip.decompress reads them; or deflate, zlib's
    format, as HTTP and gRPC name it), at most `limit` + 1 bytes of it: longer means over the limit, which
    the caller words. A stream that does not inflate, is cut short, or has bytes after its end (zeros after
    a gzip member are padding that gzip's tools write) is InvalidArgument, never served as far as it went,
    and so is gzip of more than MAX_MEMBERS members; `what` names it in the message ("the gzip body")."""
    out = bytearray()
    members = 0
    while True:
        if members == MAX_MEMBERS:
            raise InvalidArgument(f"{what} has more than {MAX_MEMBERS} gzip members; send one")
        members += 1
        inflater = zlib.decompressobj(zlib.MAX_WBITS | 16 if kind == "gzip" else zlib.MAX_WBITS)
        try:
            out += inflater.decompress(data, limit + 1 - len(out))
        except zlib.error as e:
            raise InvalidArgument(f"{what} does not inflate: {e}") from None
        if len(out) > limit:
            return bytes(out)
        if not inflater.eof:
            raise InvalidArgument(f"{what} is cut short")
        data = inflater.unused_data.lstrip(b"\x00")
        if not data:
            return bytes(out)
        if kind != "gzip":
            raise InvalidArgument(f"{len(data)} bytes after the end of {what}")
