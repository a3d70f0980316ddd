"""The request's context: its id, set once per request by whichever protocol received it, and in every log line;
and the server's log lines themselves (their format, and a throttle for lines a client can make many of).

A client may send `x-request-id` (gRPC metadata or an HTTP header); the server makes one up otherwise
and sends it back. The id lives in a ContextVar, so each request (its own task) sees its own; the
batcher's tasks have none of their own, and its lines about a batch name the requests that batch held.
"""

from __future__ import annotations

import logging
import random
import re
import sys
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import TextIO

REQUEST_ID_HEADER = "x-request-id"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"
MAX_REQUEST_ID = 128

request_id: ContextVar[str] = ContextVar("request_id", default="-")


# What a client's id may hold: UUIDs, W3C trace ids, base64 and the like. No space or bracket: an id is
# written into every log line between brackets, and "abc] INFO ... [x" would forge a line's start.
_REQUEST_ID_RE = re.compile(rf"[A-Za-z0-9._:/+=@-]{{1,{MAX_REQUEST_ID}}}\Z")


def accept_request_id(value: str | bytes | None) -> str:
    """The client's id if it is a sane one (at most 128 letters, digits and ._:/+=@-), else a new one."""
    if isinstance(value, str) and _REQUEST_ID_RE.match(value):
        return value
    # 64 random bits from Python's generator, not uuid4: its os.urandom is a system call that lets go of the
    # GIL, and under load the event loop then waited for the tokeniser or inference thread to hand it back
    # (43 us a request at 32 clients, py-spy). An id names a request in logs; it needs no secrecy. Each
    # server process seeds its generator afresh (spawned, or reseeded by Python on fork).
    return f"{random.getrandbits(64):016x}"


class RequestIdFilter(logging.Filter):
    """Puts the current request id on every log record as `%(request_id)s`."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever `sys.stderr` is when a line is written, not to the stream it was when logging was
    configured (as the standard library's own last-resort handler does). A host that replaces stderr and
    closes the old one (pytest's capture between tests, an application that runs the server in process)
    otherwise leaves every later line lost to "Logging error ... I/O operation on closed file"."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _: TextIO) -> None:
        pass  # always sys.stderr


def configure_logging(level: str, process: str | None = None) -> None:
    """The server's log lines: time, level, logger, request id, message, on stderr; with `process`, that
    name after the level (one of several server processes writing to the same stream)."""
    handler = StderrHandler()
    handler.addFilter(RequestIdFilter())
    fmt = LOG_FORMAT if process is None else LOG_FORMAT.replace("%(levelname)s", f"%(levelname)s {process}", 1)
    handler.setFormatter(logging.Formatter(fmt))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


class Throttle(logging.Filter):
    """At most `burst` lines an `interval` of each of `messages` (a record whose message starts with it), the
    next after saying how many were left out; other lines pass untouched. For a logger that writes a line for
    each of something a client can send as often as it likes."""

    def __init__(
        self,
        messages: Iterable[str],
        interval: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        burst: int = 1,
    ) -> None:
        super().__init__()
        self.messages = tuple(messages)
        self.interval = interval
        self.clock = clock
        self.burst = burst
        self._next: dict[str, float] = {}  # message -> when its interval ends
        self._written: dict[str, int] = {}  # message -> lines written in its interval
        self._left_out: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.msg
        if not isinstance(text, str) or not text.startswith(self.messages):
            return True
        left_out = self.passes(next(m for m in self.messages if text.startswith(m)))
        if left_out is None:
            return False
        if left_out:
            record.msg = f"{text} ({left_out} more since the last such line, not logged)"
        return True

    def reset(self) -> None:
        """Forget what was written and left out (a test's lines, counted from its start)."""
        self._next.clear()
        self._written.clear()
        self._left_out.clear()

    def passes(self, message: str) -> int | None:
        """Whether a line of `message` may be written now: None if not (it is counted as left out), else how many
        were left out since the last one. For a caller that words the count itself."""
        now = self.clock()
        if now >= self._next.get(message, -float("inf")):
            self._next[message] = now + self.interval
            self._written[message] = 1
            return self._left_out.pop(message, 0)
        if self._written.get(message, 0) < self.burst:  # get: another thread's window may be half set
            self._written[message] += 1
            return 0
        self._left_out[message] = self._left_out.get(message, 0) + 1
        return None


class Demote(logging.Filter):
    """Lines of `messages` (a record whose message starts with one) written at DEBUG, without their traceback, where
    a library logs at ERROR what is a client's doing, not a fault of the server's."""

    def __init__(self, messages: Iterable[str]) -> None:
        super().__init__()
        self.messages = tuple(messages)

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or not record.msg.startswith(self.messages):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.exc_info, record.exc_text = None, None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
