"""Servers for the reliability tests: the session's tiny random model, in this process or as a process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mhaserve.service.settings import Settings
from mhaserve.testing.loopback import free_port
from mhaserve.testing.process import ServerProcess
from mhaserve.testing.server import bare_settings

Spawn = Callable[..., ServerProcess]


@pytest.fixture
def settings(tiny_repo: Path) -> Settings:
    return bare_settings(tiny_repo, "tiny")


def tiny_flags(repo: Path, *extra: str, metrics_port: int = 0) -> list[str]:
    return [
        *(
            "--repository",
            str(repo),
            "--model",
            "tiny",
            "--port",
            "0",
            "--metrics-port",
            str(metrics_port),
            "--http-port",
            "0",
        ),
        *("--device", "cpu", "--intra-op-threads", "1", *extra),
    ]


@pytest.fixture
def spawn(tiny_repo: Path, tmp_path: Path) -> Iterator[Spawn]:
    """spawn(*flags, engine=None, metrics_port=0) -> a server process on the tiny model, killed after the test."""
    started: list[ServerProcess] = []

    def _spawn(*extra: str, engine: str | None = None, metrics_port: int = 0) -> ServerProcess:
        log = tmp_path / f"server-{len(started)}.log"
        proc = ServerProcess(tiny_flags(tiny_repo, *extra, metrics_port=metrics_port), log, engine=engine)
        started.append(proc)
        return proc

    yield _spawn
    for proc in started:
        proc.kill()


__all__ = ["Spawn", "free_port", "tiny_flags"]
