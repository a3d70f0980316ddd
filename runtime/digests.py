"""The sha256 of a model's files, remembered while a file stays as it was.

The server checks a model's files against its manifest at start-up, before it listens, and again as it loads
the model, in the same second; past 1.5 GB the weights are in model.onnx.data, seconds a gigabyte to read. A
file read once is not read again for a minute unless it changes. The times that tell a change are only as
good as the file system's: writes through a shared mapping move them only at a clean page's first write, and
SMB, FUSE object stores and image file systems may set them as they like. So a digest is trusted for the
moments between the start-up's check and the load, not for the life of the server: a check a minute on reads
the file again.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

# A file is known again by its device and inode (one put in its place, by a rename or a copy, is another
# inode), its size, and its modification and change times: a write moves the change time to the clock's
# now, and no user can set it back (os.utime sets the other two), so bytes changed even to the same size and
# times are read again. Only a file unchanged for this long is remembered: file system clocks are coarse (a
# kernel tick, 1-10 ms; 2 s on FAT), and a write in the same tick as the change before it leaves every time
# as it was, so a digest read in that tick might be of bytes the file no longer holds.
SETTLED_NS = 2_000_000_000
# Files remembered, the least recently checked forgotten first: three for each version of each model (graph,
# external data, tokenizer); a polled repository whose versions come and go does not grow it without end.
KEPT = 256
# How long a digest read is trusted for a file that stayed as it was (above): the start-up's check, then the load
# (a model of gigabytes reads for seconds a gigabyte before its load begins).
REUSED_NS = 60_000_000_000

# (device, inode) -> ((size, mtime, ctime), sha256, when it was read on the monotonic clock)
_known: OrderedDict[tuple[int, int], tuple[tuple[int, int, int], str, int]] = OrderedDict()
_lock = threading.Lock()  # several models load, and verify, in worker threads at once


def sha256_file(path: Path) -> str:
    """The sha256 of the file's bytes: read now, unless they were read less than REUSED_NS ago and the file has
    not changed since."""
    with path.open("rb") as f:
        # The file opened, not its path: on NFS an open fetches its attributes afresh (close-to-open), where
        # a stat may answer from the client's attribute cache for up to a minute after another host's write.
        now = time.time_ns()
        st = os.fstat(f.fileno())
        key, stamp = (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with _lock:
            known = _known.get(key)
            if known is not None and known[0] == stamp and time.monotonic_ns() - known[2] < REUSED_NS:
                _known.move_to_end(key)
                return known[1]
        began = time.monotonic_ns()  # the minute counts from the read's start: what it read, it read from then
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
        after = os.fstat(f.fileno())
    digest = h.hexdigest()
    # Not a file written to while it was read, nor one changed so lately that a write yet to come could
    # leave its times as they are.
    if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == stamp and now - max(stamp[1:]) > SETTLED_NS:
        with _lock:
            _known[key] = (stamp, digest, began)
            _known.move_to_end(key)
            while len(_known) > KEPT:
                _known.popitem(last=False)
    return digest
