"""A real `mhaserve serve` on the session's tiny random model, for the load tools to aim at."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mhaserve.loadtest.bench.client import Server


@pytest.fixture(scope="module")
def tiny_server(tiny_entry: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = Server(
        tiny_entry.parent.parent,
        models=["tiny"],
        batching="length",
        graph="auto",
        device="cpu",
        threads=1,
        extra=[],
        log_path=log,
    )
    with server.running():
        yield server
