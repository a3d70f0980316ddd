"""Real servers on free loopback ports, in a thread with their own event loop; fake engines for faults.

Tests talk to them through real channels with the synchronous grpc client (its `.future()` calls give
real concurrency without a second asyncio loop in the test thread).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from mhaserve.runtime.repository import EngineFactory
from mhaserve.service.settings import Settings
from mhaserve.testing.server import ServerThread, bare_settings, local_settings

# The statuses that say what was wrong with a request, the client's to mend, as against an error of the server's.
REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED)


@pytest.fixture(scope="module")
def server(tiny_repo: Path, grpc_front: str) -> Iterator[ServerThread]:
    """One real server per test module and gRPC front, for the tests that only read; max 8 inputs per request."""
    with ServerThread(local_settings(tiny_repo, grpc_front=grpc_front)).ready() as srv:
        yield srv


@pytest.fixture
def settings(tiny_repo: Path) -> Settings:
    """Settings for a test server: the tiny model (testing.server.bare_settings)."""
    return bare_settings(tiny_repo, "tiny")


@pytest.fixture
def start() -> Iterator[Callable[..., ServerThread]]:
    """start(settings, engine_factory=..., ready=True) -> a running server, stopped after the test."""
    servers: list[ServerThread] = []

    def _start(settings: Settings, engine_factory: EngineFactory | None = None, ready: bool = True) -> ServerThread:
        srv = ServerThread(settings, engine_factory)
        servers.append(srv)
        return srv.ready() if ready else srv

    yield _start
    for srv in servers:
        srv.stop()
