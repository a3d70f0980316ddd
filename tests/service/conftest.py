"""Real servers on free loopback ports, in a thread with their own event loop; fake engines for faults.

Tests talk to them through real channels with the synchronous grpc client (its `.future()` calls give
real concurrency without a second asyncio loop in the test thread).
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from loadtest.loopback import WAIT, free_port
from loadtest.reliability.harness import ServerThread
from service.repository import EngineFactory, onnx_engine
from service.settings import Settings


def scrape(port: int) -> dict[str, float]:
    """The metrics endpoint's samples, keyed by `name{labels}` as exposed."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT) as r:
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


class FakeEngine:
    """A deterministic engine: row = (real length, first id, sum of real ids, 1.0).

    Batches holding `fail_on` raise; batches holding `hold_on` wait for `release` (to pin what is in
    flight while a test looks); every batch's rows are recorded.
    """

    providers = ["FakeExecutionProvider"]

    def __init__(self, *, fail_on: int | None = None, hold_on: int | None = None) -> None:
        self.fail_on = fail_on
        self.hold_on = hold_on
        self.release = threading.Event()
        self.held = threading.Event()
        self.batches: list[list[list[int]]] = []

    def run(self, input_ids: npt.NDArray[np.int64], attention_mask: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        rows = [list(map(int, ids[mask == 1])) for ids, mask in zip(input_ids, attention_mask, strict=True)]
        if self.hold_on is not None and (input_ids == self.hold_on).any():
            self.held.set()
            assert self.release.wait(WAIT), "the test never released the engine"
        self.batches.append(rows)
        if self.fail_on is not None and (input_ids == self.fail_on).any():
            raise RuntimeError("injected fault\nTraceback-looking detail that must not reach clients")
        lengths = attention_mask.sum(1)
        out = np.stack([lengths, input_ids[:, 0], (input_ids * attention_mask).sum(1), np.ones(len(lengths))], 1)
        return out.astype(np.float32)

    def factory(self) -> EngineFactory:
        return lambda entry, settings: self


@pytest.fixture(scope="session")
def tiny_repo(tiny_entry: Path) -> Path:
    return tiny_entry.parent.parent


@pytest.fixture(scope="module")
def server(tiny_repo: Path) -> Iterator[ServerThread]:
    """One real server per test module, for the tests that only read; max 8 inputs per request."""
    settings = Settings(
        repository=tiny_repo,
        port=0,
        metrics_port=free_port(),
        device="cpu",
        intra_op_threads=1,
        max_client_batch_size=8,
    )
    srv = ServerThread(settings).ready()
    yield srv
    srv.stop()


@pytest.fixture
def settings(tiny_repo: Path) -> Settings:
    """Settings for a test server: the tiny model, a free port, no metrics port unless asked."""
    return Settings(repository=tiny_repo, model="tiny", port=0, metrics_port=0, device="cpu", intra_op_threads=1)


@pytest.fixture
def start() -> Iterator[Callable[..., ServerThread]]:
    """start(settings, engine_factory=..., ready=True) -> a running server, stopped after the test."""
    servers: list[ServerThread] = []

    def _start(settings: Settings, engine_factory: EngineFactory = onnx_engine, ready: bool = True) -> ServerThread:
        srv = ServerThread(settings, engine_factory)
        servers.append(srv)
        return srv.ready() if ready else srv

    yield _start
    for srv in servers:
        srv.stop()
