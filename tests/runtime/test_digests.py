"""runtime/digests.py: a file's sha256 is remembered while it stays as it was, and for a bounded number of files."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

from mhaserve.runtime import digests


def count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at each file whose bytes are hashed."""
    hashed: list[int] = []
    sha256 = hashlib.sha256

    def counting() -> Any:
        hashed.append(1)
        return sha256()

    monkeypatch.setattr(hashlib, "sha256", counting)
    return hashed


def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files written a moment ago count as settled (their digest may be remembered), as they would seconds on."""
    monkeypatch.setattr(digests, "SETTLED_NS", -(10**12))


def rewrite_in_place(path: Path, data: bytes) -> None:
    """`data` written over `path`'s bytes in place, until its change time has moved on (a file system's clock
    is coarse: a write in the tick of the one before may leave it as it was)."""
    before = path.stat().st_ctime_ns
    path.write_bytes(data)
    while path.stat().st_ctime_ns == before:
        time.sleep(0.01)
        path.write_bytes(data)


def flip_keeping_times(path: Path) -> None:
    """One byte of `path` changed in place, its inode, size and modification time kept (its change time moves)."""
    was = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rewrite_in_place(path, bytes(data))
    os.utime(path, ns=(was.st_atime_ns, was.st_mtime_ns))
    now = path.stat()
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (was.st_ino, was.st_size, was.st_mtime_ns)


def test_a_file_changed_a_moment_ago_is_read_at_each_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write in the same tick of the file system's clock as the change before it leaves the file's times as
    they were: a digest read in that tick is not kept, lest it vouch for bytes the file no longer holds."""
    (path := tmp_path / "f").write_bytes(b"x")
    hashed = count_hashing(monkeypatch)
    digests.sha256_file(path)
    digests.sha256_file(path)
    assert len(hashed) == 2
    settled(monkeypatch)  # as it will be seconds on
    digests.sha256_file(path)
    digests.sha256_file(path)
    assert len(hashed) == 3


def test_the_files_remembered_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A polled repository whose versions come and go: the least recently checked file is forgotten first."""
    settled(monkeypatch)
    monkeypatch.setattr(digests, "KEPT", 2)
    monkeypatch.setattr(digests, "_known", type(digests._known)())
    files = []
    for i in range(3):
        (path := tmp_path / f"f{i}").write_bytes(b"x" * i)
        files.append(path)
        assert digests.sha256_file(path) == hashlib.sha256(b"x" * i).hexdigest()
    assert len(digests._known) == 2
    hashed = count_hashing(monkeypatch)
    digests.sha256_file(files[2])
    digests.sha256_file(files[1])
    assert len(hashed) == 0
    digests.sha256_file(files[0])  # forgotten: the first read
    assert len(hashed) == 1


def test_a_digest_is_trusted_for_a_minute_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The times that tell a change are only as good as the file system's (a shared mapping's writes, SMB, FUSE
    object stores): a digest vouches for the start-up's check and the load after it, not for the server's life."""
    settled(monkeypatch)
    (path := tmp_path / "f").write_bytes(b"x")
    digests.sha256_file(path)
    hashed = count_hashing(monkeypatch)
    digests.sha256_file(path)
    assert len(hashed) == 0
    clock = time.monotonic_ns() + digests.REUSED_NS
    monkeypatch.setattr(time, "monotonic_ns", lambda: clock)
    digests.sha256_file(path)
    assert len(hashed) == 1
