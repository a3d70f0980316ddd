"""OS names for the server's own threads, so that `top -H`, `ps -L` and the bench's CPU accounting tell the
inference thread and the tokeniser threads apart: Python leaves every thread it starts with the process's
name. The event loop keeps the process's name (it is the main thread, whose name `ps` shows for the
process), and the threads of gRPC's core name themselves."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_PR_SET_NAME = 15  # <linux/prctl.h>


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def name_this_thread(name: str) -> None:
    """Set the calling thread's OS name (Linux keeps 15 bytes of it); nothing happens elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def named_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """A thread pool whose threads carry `name` for the operating system as well as for Python."""
    return ThreadPoolExecutor(
        max_workers=workers, thread_name_prefix=name, initializer=name_this_thread, initargs=(name,)
    )


class CountingPool(ThreadPoolExecutor):
    """A named pool that knows how many of its calls are running now: at the end of a stop, one still
    running (an engine that never returns) would hold the interpreter's exit, which joins these threads."""

    def __init__(self, name: str, workers: int) -> None:
        super().__init__(max_workers=workers, thread_name_prefix=name, initializer=name_this_thread, initargs=(name,))
        self._running = 0
        self._lock = threading.Lock()

    @property
    def running(self) -> int:
        return self._running

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        def counted() -> T:
            with self._lock:
                self._running += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self._running -= 1

        return super().submit(counted)
