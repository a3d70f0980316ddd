"""Running things on this machine's loopback: a free port, and waiting for another process or thread."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable

WAIT = 30.0  # seconds anything is waited for before giving up


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports: each socket is held until all are chosen, so the OS cannot pick one twice."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def free_port_run(n: int, avoid: tuple[int, ...] = ()) -> int:
    """A port such that it and the `n - 1` after it are free now and none is in `avoid`: for a server
    whose processes serve metrics on consecutive ports (`mhaserve serve --processes`)."""
    for _ in range(100):
        base = free_port()
        run = range(base, base + n)
        if base + n - 1 > 65535 or any(port in avoid for port in run):
            continue
        try:
            with contextlib.ExitStack() as held:
                for port in run:
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"found no {n} consecutive free ports")


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT, interval: float = 0.01) -> None:
    """Poll a condition that cannot be awaited (state in another thread or process), with a deadline."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
