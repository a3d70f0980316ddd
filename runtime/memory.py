"""Giving freed memory back to the operating system.

glibc's malloc keeps what a closed ONNX Runtime session freed in its arenas (one per thread that
allocated), so a server that swaps model versions would look as if it leaked: the memory is free for
the process to reuse, but its resident size keeps the high-water mark. `malloc_trim(0)` returns the
free pages; elsewhere (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.malloc_trim  # noqa: B018 (glibc only)
    except (OSError, AttributeError):
        return None
    return libc


def release_free_memory() -> bool:
    """Return the heap's free pages to the system; whether anything could be asked to."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
