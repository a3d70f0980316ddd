"""Client connections a server process holds open, over both protocols, against one limit below its file descriptors.

Every connection holds a file descriptor, and a process may hold only so many (RLIMIT_NOFILE: 1024 in many
containers). At that limit a listening socket's `accept` fails with EMFILE, and Python 3.11's asyncio then logs the
failure, traceback and all, once for every connection waiting in the listen backlog, and retries each second: a
server allowed 256 descriptors and sent 600 idle connections wrote 716,852 log lines in 15 s, answered no new
client, and could not read its model repository (no descriptor left to open a file with). So:

- at start-up the process raises its soft limit of descriptors to the hard one, as Go's runtime does;
- connections are admitted up to a limit (--max-connections; by default the descriptors less RESERVE, at most
  DEFAULT_LIMIT), counted over the lean gRPC front and HTTP together, so that the server's own files, pipes,
  the repository poll and the metrics port's scrapes always find a descriptor;
- asyncio accepts at most ACCEPT_BATCH connections each time a listening socket is ready (it took as many as
  the backlog, 1024, before any of them was counted);
- should the descriptors run out all the same, asyncio's line about it is written once a minute at most;
- a connection over the limit is closed at once, the server's answer to it depending on its protocol (the lean
  front closes it unread: a gRPC client then reports UNAVAILABLE at once and waits its reconnect backoff; HTTP
  answers 503 with Retry-After, at most ANSWERED_AT_ONCE at a time). Each is counted in
  `mhaserve_connections_refused_total`.

grpc.aio's front accepts connections in grpc core, out of our count: it gets the same limit as a channel option
of its own (`grpc.max_allowed_incoming_connections`).
"""

from __future__ import annotations

import collections
import logging
import resource
import socket
import time
from collections.abc import Callable

from prometheus_client import Counter

from mhaserve.service.context import Throttle

log = logging.getLogger(__name__)

# Descriptors a server process keeps for itself besides its client connections: its listening sockets, the
# model files and the repository poll, log files, the event loop's and the thread pools' pipes, ONNX Runtime,
# the metrics port (a thread and a descriptor per scrape, each cut after 10 s), and new connections between their
# accept and the count (up to ACCEPT_BATCH a listener each time its socket is ready, for 2-3 turns of the loop).
RESERVE = 256
# Connections a process admits by default at most, whatever its descriptors: far more than its clients need (a
# gRPC client holds one connection, an HTTP client's pool 10 to 100), and a bound on the memory they hold
# (uvicorn reads up to 64 KiB ahead on each, 256 MiB at this limit). --max-connections sets another.
DEFAULT_LIMIT = 4096
# asyncio's accept loop takes up to its server's `backlog` connections each time the listening socket is ready,
# before any protocol sees one (CPython's bpo-27906): a burst of new connections took 1024 descriptors at once, past
# any limit, and on EMFILE it schedules a retry for each one it could not take. So both fronts create their servers
# with this as `backlog` and then give the kernel's queue its own length again (`bounded_accepts`).
ACCEPT_BATCH = 16
ANSWERED_AT_ONCE = RESERVE // 4  # refused connections answered at once, at most (ConnectionLimit.start_answer)
FEWEST = 16  # the least the default gives, on a process with very few descriptors
# Linux refuses a soft limit over fs.nr_open, whatever the hard limit; its default is 2**20.
NR_OPEN = "/proc/sys/fs/nr_open"


def raise_file_limit() -> tuple[int, int]:
    """Raise the process's soft limit of open files to its hard limit (Linux caps it at fs.nr_open); returns the
    soft limit before and after. A limit that cannot be raised (a sandbox's) is left as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open(NR_OPEN) as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return soft, soft
        return soft, target
    return soft, soft


# asyncio's line for an accept that failed for want of a descriptor, with its traceback: written once for every
# connection waiting in the backlog, each time the listener is tried again (the module docstring). Should the
# descriptors run out all the same (the metrics port's scrapes are not counted), one line a minute of it.
ACCEPT_FAILED = Throttle(("socket.accept() out of system resource",))


def throttle_accept_failures() -> None:
    """Put ACCEPT_FAILED on asyncio's logger (once: servers in one process share it)."""
    logger = logging.getLogger("asyncio")
    if ACCEPT_FAILED not in logger.filters:
        logger.addFilter(ACCEPT_FAILED)


def bounded_accepts(sock: socket.socket, backlog: int) -> None:
    """After asyncio's create_server(sock=sock, backlog=ACCEPT_BATCH): the kernel's queue of connections not yet
    accepted back at `backlog` (a listening socket takes a new length)."""
    sock.listen(backlog)


def default_limit(files: int) -> int:
    """--max-connections when it is not set, for a process that may hold `files` descriptors."""
    return max(FEWEST, min(DEFAULT_LIMIT, files - RESERVE))


class ConnectionLimit:
    """The count of open client connections against `limit`. Used on the event loop only: both fronts serve on it.

    A refusal is counted in `refused` (by protocol, and in the metric when given) and logged as a warning, at most
    one line a minute: a client pool that keeps reconnecting would otherwise write a line for each attempt."""

    def __init__(
        self,
        limit: int,
        *,
        refused: Counter | None = None,
        log_every: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.open = 0
        self.answering = 0  # refused connections still being answered (start_answer)
        self.refused: collections.Counter[str] = collections.Counter()
        self._metric = refused
        self._lines = Throttle((), interval=log_every, clock=clock)

    def admit(self, protocol: str) -> bool:
        """Count a new connection of `protocol` in, or, at the limit, refuse it (the caller closes it)."""
        if self.open < self.limit:
            self.open += 1
            return True
        self.refused[protocol] += 1
        if self._metric is not None:
            self._metric.labels(protocol).inc()
        left_out = self._lines.passes("refused")
        if left_out is not None:
            log.warning(
                "refused a new %s connection: %d connections are open, the limit (--max-connections)%s",
                protocol,
                self.open,
                f" ({left_out} more since the last such line)" if left_out else "",
            )
        return False

    def start_answer(self) -> bool:
        """Take a place for answering a refused connection before it closes (HTTP's 503), if one is free: each
        holds a descriptor a moment, so at most ANSWERED_AT_ONCE are, and past them a refusal is closed unanswered."""
        if self.answering >= ANSWERED_AT_ONCE:
            return False
        self.answering += 1
        return True

    def end_answer(self) -> None:
        self.answering -= 1

    def release(self) -> None:
        """An admitted connection has closed."""
        self.open -= 1
