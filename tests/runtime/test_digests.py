"""runtime/digests.py: a file's sha256 is remembered while it stays as it was, and for a bounded number of files."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from mhaserve.runtime import digests


def _count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at each file whose bytes are hashed."""
    hashed: list[int] = []
    sha256 = hashlib.sha256

    def counting() -> Any:
        hashed.append(1)
        return sha256()

    monkeypatch.setattr(hashlib, "sha256", counting)
    return hashed


def test_a_file_changed_a_moment_ago_is_read_at_each_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write in the same tick of the file system's clock as the change before it leaves the file's times as
    they were: a digest read in that tick is not kept, lest it vouch for bytes the file no longer holds."""
    (path := tmp_path / "f").write_bytes(b"x")
    hashed = _count_hashing(monkeypatch)
    digests.sha256_file(path)
    digests.sha256_file(path)
    assert len(hashed) == 2
    monkeypatch.setattr(digests, "SETTLED_NS", -(10**12))  # as it will be seconds on
    digests.sha256_file(path)
    digests.sha256_file(path)
    assert len(hashed) == 3


def test_the_files_remembered_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A polled repository whose versions come and go: the least recently checked file is forgotten first."""
    monkeypatch.setattr(digests, "SETTLED_NS", -(10**12))  # files written a moment ago count as settled
    monkeypatch.setattr(digests, "KEPT", 2)
    monkeypatch.setattr(digests, "_known", type(digests._known)())
    files = []
    for i in range(3):
        (path := tmp_path / f"f{i}").write_bytes(b"x" * i)
        files.append(path)
        assert digests.sha256_file(path) == hashlib.sha256(b"x" * i).hexdigest()
    assert len(digests._known) == 2
    hashed = _count_hashing(monkeypatch)
    digests.sha256_file(files[2])
    digests.sha256_file(files[1])
    assert len(hashed) == 0
    digests.sha256_file(files[0])  # forgotten: the first read
    assert len(hashed) == 1
