"""Soak: steady load for minutes while the server's memory, descriptors and threads are sampled."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

import grpc

from mhaserve.loadtest.reliability.scenarios.common import OK
from mhaserve.loadtest.reliability.scenarios.load import Requests, closed_loop
from mhaserve.loadtest.stats import slope
from mhaserve.service.client import CHANNEL_OPTIONS
from mhaserve.testing.loopback import WAIT
from mhaserve.testing.process import Sample, ServerProcess, sample


@dataclass
class SoakResult:
    seconds: float
    warmup: float
    clients: int
    codes: Counter[str]
    samples: list[Sample]
    bound_kib_per_min: float

    def steady(self) -> list[Sample]:
        return [s for s in self.samples if s.t >= self.warmup]

    @property
    def rss_slope_kib_per_min(self) -> float:
        steady = self.steady()
        return 60 * slope([s.t for s in steady], [float(s.rss_kib) for s in steady])

    @property
    def requests(self) -> int:
        return sum(self.codes.values())


def soak(
    proc: ServerProcess,
    request: Requests,
    *,
    seconds: float,
    clients: int = 4,
    interval: float = 1.0,
    warmup: float | None = None,
    bound_kib_per_min: float = 1024.0,
) -> SoakResult:
    """Steady closed-loop load for `seconds`, the server's resident memory, descriptors and threads sampled
    every `interval`; the memory slope is fitted after `warmup` seconds (default: the first quarter)."""
    address = proc.address()
    warmup = seconds / 4 if warmup is None else warmup
    samples: list[Sample] = []
    t0 = time.monotonic()
    done = threading.Event()

    def sampler() -> None:
        while not done.is_set():
            samples.append(sample(proc.pid, t0))
            done.wait(interval)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    channels = [grpc.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(2)]
    try:
        calls = closed_loop(channels, request, clients=clients, seconds=seconds)
    finally:
        done.set()
        thread.join(WAIT)
        for ch in channels:
            ch.close()
    samples.append(sample(proc.pid, t0))
    codes = Counter(c.code if c.code != OK or c.correct else "OK (wrong answer)" for c in calls)
    return SoakResult(seconds, warmup, clients, codes, samples, bound_kib_per_min)
