"""Servers to test against (in this process on their own loop, or as a real process) and what to measure.

Every wait has a deadline; nothing here sends traffic anywhere but 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtest.loopback import WAIT, wait_until
from service.repository import EngineFactory, onnx_engine
from service.server import EncoderServer
from service.settings import Settings

T = TypeVar("T")
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 256 * 1024 * 1024)]


def health_status(channel: grpc.Channel, timeout: float = WAIT) -> str:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


class ServerThread:
    """An EncoderServer on its own event loop in a daemon thread of this process."""

    def __init__(self, settings: Settings, engine_factory: EngineFactory = onnx_engine) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="server-loop")
        self.thread.start()
        self.server = EncoderServer(settings, engine_factory=engine_factory)
        try:
            self.call(self.server.start())
        except BaseException:
            self._close_loop()
            raise

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = WAIT) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def ready(self) -> ServerThread:
        self.call(self.server.ready(), timeout=120)
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)

    def depth(self) -> int:
        return 0 if self.server.batcher is None else self.server.batcher.depth

    def counted(self, code: str, method: str = "encoder.v1.EncoderService/Encode") -> int:
        value = self.server.metrics.registry.get_sample_value(
            "mhaserve_requests_total", {"method": method, "code": code}
        )
        return int(value or 0)

    def counted_all(self, code: str) -> int:
        """Calls answered with `code`, all methods together."""
        total = 0.0
        for family in self.server.metrics.registry.collect():
            for sample in family.samples:
                if sample.name == "mhaserve_requests_total" and sample.labels.get("code") == code:
                    total += sample.value
        return int(total)

    def gauge(self, name: str) -> float:
        return float(self.server.metrics.registry.get_sample_value(name) or 0.0)

    def tasks(self) -> int:
        """asyncio tasks alive on the server's loop, not counting the one that asks."""

        async def count() -> int:
            return len(asyncio.all_tasks()) - 1

        return self.call(count())

    def stop(self, grace: float = 5.0) -> None:
        try:
            if self.server.state != "stopped":
                self.call(self.server.stop(grace), timeout=grace + WAIT)
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


def live_objects(*type_names: str) -> dict[str, int]:
    """How many objects of each named class are alive (after a collection): leaks show as growth."""
    gc.collect()
    counts = dict.fromkeys(type_names, 0)
    for obj in gc.get_objects():
        name = type(obj).__name__
        if name in counts:
            counts[name] += 1
    return counts


# ---- a real process ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One look at a process: seconds since the first look, resident memory, open descriptors, threads."""

    t: float
    rss_kib: int
    fds: int
    threads: int


def sample(pid: int, t0: float) -> Sample:
    """From /proc (Linux)."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1))  # type: ignore[union-attr]
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return Sample(time.monotonic() - t0, rss, fds, threads)


class ServerProcess:
    """`mhaserve serve` (or the fake-engine server, `engine=` a spec) as a child process, logging to a file."""

    def __init__(self, flags: Sequence[str], log_path: Path, *, engine: str | None = None) -> None:
        if engine is None:
            command = [sys.executable, "-m", "service.cli", "serve", *flags]
        else:
            command = [sys.executable, "-m", "loadtest.reliability.fake_server", "--engine", engine, *flags]
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, text=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def port(self, timeout: float = 120.0) -> int:
        found: list[int] = []

        def listening() -> bool:
            found.extend(int(m.group(1)) for m in re.finditer(r"listening on [\d.]+:(\d+)", self.log))
            return bool(found) or self.proc.poll() is not None

        wait_until(listening, "the server to listen", timeout)
        if not found:
            raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log}")
        return found[0]

    def address(self) -> str:
        return f"127.0.0.1:{self.port()}"

    def wait_serving(self, timeout: float = 180.0) -> str:
        address = self.address()

        def serving() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log}")
            with grpc.insecure_channel(address) as channel:
                try:
                    return health_status(channel, timeout=2.0) == "SERVING"
                except grpc.RpcError:
                    return False

        wait_until(serving, "the server to report SERVING", timeout)
        return address

    def signal(self, sig: signal.Signals = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = WAIT) -> int:
        code = self.proc.wait(timeout)
        self._log.close()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(WAIT)
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


# ---- figures ----------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs (0 for fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
