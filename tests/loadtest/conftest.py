"""A real `mhaserve serve` on the session's tiny random model, for the load tools to aim at."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mhaserve.loadtest.bench.client import Server


def bench_server(entry: Path, log: Path, models: list[str] | None = None, extra: list[str] | None = None) -> Server:
    """The bench's server subprocess (not started) on a tiny model entry's repository."""
    return Server(
        entry.parent.parent,
        models=models or ["tiny"],
        batching="length",
        graph="auto",
        device="cpu",
        threads=1,
        extra=extra or [],
        log_path=log,
    )


@pytest.fixture(scope="module")
def tiny_server(tiny_entry: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = bench_server(tiny_entry, tmp_path_factory.mktemp("server") / "server.log")
    with server.running():
        yield server
