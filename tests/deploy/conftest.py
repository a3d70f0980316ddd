"""Fixtures for the deployment tests: real `mhaserve serve` replicas on free loopback ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.deploy.helpers import Replica


@pytest.fixture(scope="session")
def tiny_repo(tiny_entry: Path) -> Path:
    """The model repository holding the session's tiny random model (tests/conftest.py exports it)."""
    return tiny_entry.parent.parent


@pytest.fixture
def replicas(tiny_repo: Path, tmp_path: Path) -> Iterator[Callable[[int], list[Replica]]]:
    """Start n replicas; all of them are stopped after the test, whatever happened."""
    started: list[Replica] = []

    def start(n: int) -> list[Replica]:
        for _ in range(n):
            started.append(Replica(tiny_repo, tmp_path, f"replica{len(started)}"))
        return started[-n:]

    try:
        yield start
    finally:
        for r in started:
            r.stop()
