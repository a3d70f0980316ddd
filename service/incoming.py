"""Request bytes a server process holds while they arrive: one budget over every connection of both protocols.

A request is read whole before anything runs it (a gRPC message up to --max-message-bytes, an HTTP body up to
the same), so what a client has sent of a request it has not finished is memory of ours it chooses how long to
hold. A connection may hold many such requests (1,000 calls on the lean gRPC front; HTTP connections are not
limited in number), and nothing else bounds them together: 200 calls on one connection, each 2 MiB into a 4 MiB
message, held 469 MiB of the lean front (docs/grpc-fronts.md). So the bytes received and not yet taken by their
call (an HTTP body until it is complete; on the lean front a message still arriving, and whole messages its call
has not read yet) are counted here, and a request whose next bytes would pass the limit is refused (QueueFull:
RESOURCE_EXHAUSTED, HTTP 429 with Retry-After), its bytes let go; a request that arrives whole in one read is
counted only until its call takes it, and is refused only when the limit is already reached. grpc.aio's front
reads messages in grpc core, out of our reach: it is not counted (docs/grpc-fronts.md).
"""

from __future__ import annotations

from mhaserve.runtime.errors import QueueFull

# The limit by default: 64 requests at the default message limit arriving at once, far more than 2-32 clients'
# traffic holds, and a bound on what clients that never finish their requests can take.
DEFAULT_LIMIT = 256 << 20


def default_limit(max_message_bytes: int) -> int:
    """--max-incoming-bytes when it is not set: DEFAULT_LIMIT, or two messages at the limit if that is more."""
    return max(DEFAULT_LIMIT, 2 * max_message_bytes)


class Incoming:
    """The count of request bytes held while they arrive, against `limit`. Used on the event loop only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def admits(self, size: int) -> bool:
        """Whether `size` more bytes fit."""
        return self.held + size <= self.limit

    def refusal(self) -> QueueFull:
        return QueueFull(
            f"the server holds its limit of request bytes still arriving ({self.limit} bytes, "
            "--max-incoming-bytes): retry later"
        )
