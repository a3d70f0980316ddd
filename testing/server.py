"""A real server in this process, on its own event loop in a thread: what most tests and scenarios talk to.

Every wait has a deadline; nothing here sends traffic anywhere but 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mhaserve.runtime.repository import EngineFactory
from mhaserve.service.client import CHANNEL_OPTIONS
from mhaserve.service.models import Served
from mhaserve.service.server import SETTLE_S, EncoderServer, settle
from mhaserve.service.settings import Settings
from mhaserve.testing.loopback import WAIT, free_ports
from mhaserve.testing.metrics import Samples, from_registry

T = TypeVar("T")


def health_status(channel: grpc.Channel, timeout: float = WAIT) -> str:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def bare_settings(repository: Path, *models: str, **overrides: Any) -> Settings:
    """A test server's settings with nothing on a fixed port: `models` from `repository` on the CPU, with one
    inference worker of one thread (so that batches form as a test expects on any host), gRPC and HTTP on
    ports of the system's choosing, no metrics port; `overrides` for what a test needs otherwise."""
    values: dict[str, Any] = {
        "repository": repository,
        "model": models,
        "port": 0,
        "metrics_port": 0,
        "http_port": 0,
        "device": "cpu",
        "intra_op_threads": 1,
        "inference_workers": 1,
    }
    return Settings(**(values | overrides))


def local_settings(repository: Path, **overrides: Any) -> Settings:
    """bare_settings for the repository's models, with HTTP and metrics on free loopback ports and at most 8
    inputs per request (small limits make the limit tests cheap); `overrides` for what a test needs otherwise."""
    metrics, http = free_ports(2)  # two at once: two calls to free_port can each be given the same port
    local = {"metrics_port": metrics, "http_port": http, "max_client_batch_size": 8}
    return bare_settings(repository, **(local | overrides))


class ServerThread:
    """An EncoderServer on its own event loop in a daemon thread of this process."""

    def __init__(
        self, settings: Settings, engine_factory: EngineFactory | None = None, pinned: Served | None = None
    ) -> None:
        """`pinned`: the versions to serve as they were, as a process of --processes started again does."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="server-loop")
        self.thread.start()
        self.server = EncoderServer(settings, engine_factory=engine_factory, pinned=pinned)
        try:
            self.call(self.server.start())
        except BaseException:
            self._close_loop()
            raise

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = WAIT) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call_soon(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the server's loop and return at once; the future has its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def ready(self) -> ServerThread:
        self.call(self.server.ready(), timeout=120)
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def http_url(self) -> str:
        """http://127.0.0.1:PORT of the HTTP API (the server must have been given an http_port)."""
        assert self.server.http_port, "this server has no HTTP port (http_port=0)"
        return f"http://127.0.0.1:{self.server.http_port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)

    def depth(self) -> int:
        """Inputs waiting, every model version together."""
        return sum(p.batcher.depth for p in self.server.dataplane.pipelines())

    def samples(self) -> Samples:
        return from_registry(self.server.metrics.registry)

    def counted(self, code: str, method: str = "encoder.v1.EncoderService/Encode") -> int:
        return int(self.samples().get("mhaserve_requests_total", method=method, code=code))

    def counted_all(self, code: str) -> int:
        """Calls answered with `code`, all methods together."""
        return int(self.samples().get("mhaserve_requests_total", code=code))

    def gauge(self, name: str, **labels: str) -> float:
        """A gauge's value, summed over the label sets that include `labels` (every model, by default)."""
        return self.samples().get(name, **labels)

    def tasks(self) -> int:
        """asyncio tasks alive on the server's loop, not counting the one that asks."""

        async def count() -> int:
            return len(asyncio.all_tasks()) - 1

        return self.call(count())

    def stop(self, grace: float = 5.0) -> None:
        """Stop the server as `mhaserve serve` does: its drain and grace period, then the calls gRPC handed over
        as it stopped let finish (refused), before the loop closes (which would cancel them)."""
        try:
            if self.server.state != "stopped":
                self.call(self.server.stop(grace), timeout=grace + WAIT)
                self.call(settle(SETTLE_S), timeout=SETTLE_S + WAIT)
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT)
        self.loop.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
