"""HTTP/2 frames (RFC 9113) and the header blocks the lean front sends.

Every header block it writes uses HPACK's literal representation without indexing (RFC 7541 6.2.2) and
no Huffman coding, so it never changes either side's dynamic table: a block can be made once and sent on
any connection, in any order. Only decoding needs a table (the `hpack` package, one decoder a connection);
`indexed_fields` reads the block a grpc core client sends on every call after its first.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Iterator

import hpack
from hpack.table import HeaderTable

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
NAMES = ("DATA", "HEADERS", "PRIORITY", "RST_STREAM", "SETTINGS", "PUSH_PROMISE", "PING", "GOAWAY", "WINDOW_UPDATE",
         "CONTINUATION")  # fmt: skip
# flags
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# settings
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = (
    range(1, 7)
)
# error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED = 0x0, 0x1, 0x2, 0x3, 0x5
FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x6, 0x7, 0x8, 0x9, 0xB

DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = (1 << 31) - 1


class FrameTooLarge(ValueError):
    """A frame longer than the receiver allows (FRAME_SIZE_ERROR)."""


def whole_frames(buf: bytearray, max_length: int = 1 << 24) -> Iterator[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of each whole frame at the start of `buf`, removed from it as they are
    taken; a partial frame stays for the next read."""
    while len(buf) >= 9:
        length = (buf[0] << 16) | (buf[1] << 8) | buf[2]
        if length > max_length:
            raise FrameTooLarge(f"a frame of {length} bytes")
        if len(buf) < 9 + length:
            return
        kind, flags = buf[3], buf[4]
        stream = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
        payload = bytes(buf[9 : 9 + length])
        del buf[: 9 + length]
        yield kind, flags, stream, payload


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One frame: its 9-byte header, then the payload."""
    n = len(payload)
    return bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags)) + stream.to_bytes(4, "big") + payload


def settings(*pairs: tuple[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in pairs))


def window_update(stream: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream, increment.to_bytes(4, "big"))


def rst_stream(stream: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream, code.to_bytes(4, "big"))


def goaway(last_stream: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, last_stream.to_bytes(4, "big") + code.to_bytes(4, "big") + debug)


def _integer(value: int, prefix_bits: int) -> bytes:
    """HPACK's integer with an N-bit prefix (RFC 7541 5.1); the representation's own bits are zero here."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out = bytearray((limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(data: bytes) -> bytes:
    return _integer(len(data), 7) + data  # the top bit 0: not Huffman-coded


def header_block(fields: Iterable[tuple[str, str | bytes]]) -> bytes:
    """Literal fields without indexing, new names: a block that leaves HPACK's dynamic table alone."""
    out = bytearray()
    for name, value in fields:
        raw = value if isinstance(value, bytes) else value.encode("latin-1")
        out += b"\x00" + _string(name.encode("ascii")) + _string(raw)
    return bytes(out)


def indexed_fields(block: bytes, table: HeaderTable, max_list_size: int) -> list[tuple[str, str]] | None:
    """The fields of a header block made only of one-byte indexed fields (RFC 7541 6.1), read from `table`;
    None for any other block, to be decoded by `hpack` (which also raises what a bad one deserves).

    After its first call on a connection a grpc core client (Python's, C++'s, C#'s, Ruby's...) sends every
    header as an index into the table, `grpc-timeout` included (it reuses the index of a timeout it sent
    before): 8 or 9 bytes a call. `hpack`'s decoder, pure Python, took 24-33 us on such a block of 8 fields;
    this takes 5-6 us. Such a block leaves the table as it was, so skipping the decoder keeps both sides' tables
    in step."""
    if not block or min(block) <= 0x80 or max(block) == 0xFF:  # 0x80: index 0; 0xFF: an index of two bytes
        return None
    fields = []
    size = 0
    try:
        for b in block:
            name, value = table.get_by_index(b & 0x7F)
            size += 32 + len(name) + len(value)  # RFC 7541 4.1's entry size, which the list limit counts
            fields.append((name.decode("utf-8"), value.decode("utf-8")))
    except (hpack.HPACKError, UnicodeDecodeError):  # an index past the table, a value not UTF-8
        return None
    return fields if size <= max_list_size else None


# `:status: 200` is entry 8 of HPACK's static table, one byte.
STATUS_200 = b"\x88"
RESPONSE_HEADERS = STATUS_200 + header_block((("content-type", "application/grpc"),))
OK_TRAILER = header_block((("grpc-status", "0"),))
# What a call refused for a message compressed in an algorithm we lack is told we read (gRPC's compression
# guide), as grpc core names them: added to that call's trailers alone, not to every answer.
ACCEPT_ENCODING = header_block((("grpc-accept-encoding", "identity,deflate,gzip"),))

_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def grpc_timeout(value: str) -> float | None:
    """Seconds from a `grpc-timeout` header (up to 8 digits and a unit); None if it is not one."""
    # ASCII digits: isdigit() is also true of "²" (which int() refuses: a ValueError that ended the connection)
    # and "١" (which int() reads)
    if 2 <= len(value) <= 9 and value.isascii() and value[:-1].isdigit() and value[-1] in _TIMEOUT_UNITS:
        return int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]
    return None


def header_list_size(fields: Iterable[tuple[str, str]]) -> int:
    """A header list's size as SETTINGS_MAX_HEADER_LIST_SIZE counts it: each field's name and value in bytes,
    and 32 more (RFC 9113 6.5.2)."""
    return sum(32 + len(name.encode()) + len(value.encode()) for name, value in fields)


def grpc_message(text: str) -> bytes:
    """`grpc-message`'s percent-encoding of UTF-8 (gRPC's HTTP/2 protocol): printable ASCII but `%` as is."""
    out = bytearray()
    for b in text.encode("utf-8"):
        out += bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}".encode()
    return bytes(out)


def metadata_value(key: str, value: str | bytes) -> bytes:
    """A metadata value as sent: a `-bin` key's bytes in base64 without padding, any other as text."""
    if key.endswith("-bin"):
        raw = value if isinstance(value, bytes) else value.encode()
        return base64.b64encode(raw).rstrip(b"=")
    return value if isinstance(value, bytes) else value.encode("latin-1")


def trailer_block(code: int, message: str, metadata: Iterable[tuple[str, str | bytes]]) -> bytes:
    """The trailers' header block: `grpc-status`, `grpc-message` if any, then the trailing metadata."""
    if code == 0 and not message and not metadata:
        return OK_TRAILER
    fields: list[tuple[str, str | bytes]] = [("grpc-status", str(code))]
    if message:
        fields.append(("grpc-message", grpc_message(message)))
    fields += [(key, metadata_value(key, value)) for key, value in metadata]
    return header_block(fields)


def metadata_from_header(key: str, value: str) -> str | bytes:
    """A received metadata value: a `-bin` key's base64 (padded or not) as bytes, any other as its text. A `-bin`
    value that is not base64 raises ValueError (b64decode would otherwise skip what is not of its alphabet)."""
    if key.endswith("-bin"):
        return base64.b64decode(value + "=" * (-len(value) % 4), validate=True)
    return value


_REQUEST_PSEUDO = frozenset({":method", ":scheme", ":path", ":authority"})
# RFC 9113 8.2.1: a name is visible ASCII but uppercase and colons, after a pseudo-header's one colon; a value
# holds no NUL, CR or LF. (An empty name once reached the call's reading, which took the connection down.)
_NAME = re.compile(r":?[\x21-\x39\x3b-\x40\x5b-\x7e]+\Z")
_BAD_VALUE = re.compile(r"[\x00\r\n]")
# The names a gRPC client's request has, taken without a look: the check above is half of this function's time
_USUAL = _REQUEST_PSEUDO | {"content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding", "user-agent"}
# Headers of one hop of HTTP/1.1, which HTTP/2 forbids (RFC 9113 8.2.2).
_CONNECTION_SPECIFIC = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"})


def malformed(fields: Iterable[tuple[str, str]], *, trailers: bool = False) -> str | None:
    """Why a request's header block (or, with `trailers`, its trailers) is malformed by RFC 9113 8.2 and 8.3,
    or None: a name not in lowercase; a pseudo-header unknown, repeated, after a regular header or in
    trailers; a connection-specific header; TE other than "trailers"; :method, :scheme or :path missing, or
    :path empty; a name of other characters than RFC 9113 8.2.1's, a value with NUL, CR or LF. Such a request is
    a stream error, answered with RST_STREAM PROTOCOL_ERROR, not a call."""
    seen: set[str] = set()
    regular = False
    for name, value in fields:
        if name not in _USUAL and _NAME.match(name) is None:
            if name != name.lower():
                return f"a header name not in lowercase ({name!r})"
            return f"a header name empty or of characters no name has ({name!r})"
        if _BAD_VALUE.search(value):
            return f"a header value with NUL, CR or LF ({name})"
        if name[:1] == ":":
            if trailers:
                return f"a pseudo-header in trailers ({name})"
            if regular:
                return f"a pseudo-header after a regular header ({name})"
            if name not in _REQUEST_PSEUDO or name in seen:
                return f"{'a repeated' if name in seen else 'an unknown'} pseudo-header ({name})"
            if name == ":path" and not value:
                return "an empty :path"
            seen.add(name)
        else:
            regular = True
            if name in _CONNECTION_SPECIFIC:
                return f"a connection-specific header ({name})"
            if name == "te" and value != "trailers":
                return f"TE {value!r}, where only 'trailers' is allowed"
    if not trailers and len(seen - {":authority"}) < 3:
        missing = sorted({":method", ":scheme", ":path"} - seen)
        return f"no {' or '.join(missing)}"
    return None
