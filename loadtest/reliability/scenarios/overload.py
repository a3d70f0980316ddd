"""Overload: an open-loop burst at a multiple of the measured capacity, with closed loops before and after."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from mhaserve.loadtest.reliability.scenarios.common import OK
from mhaserve.loadtest.reliability.scenarios.load import Call, Requests, closed_loop, open_loop, windows
from mhaserve.loadtest.stats import percentile
from mhaserve.service.client import CHANNEL_OPTIONS
from mhaserve.testing.loopback import WAIT, wait_until


@dataclass(frozen=True)
class Latencies:
    """p50, p99 and max of some latencies, in seconds (NaN when there were none)."""

    count: int
    p50: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Latencies:
        return cls(len(values), percentile(values, 50), percentile(values, 99), max(values, default=float("nan")))


@dataclass
class OverloadResult:
    """An open-loop burst at `factor` times the measured capacity, with closed-loop runs before and after."""

    max_queue_size: int
    capacity: float  # requests (of one input) answered per second, closed loop, before the burst
    factor: float
    offered_rate: float  # requests/s the burst aimed at
    sent_rate: float  # requests/s it really sent
    burst_seconds: float
    sent: int
    answered: int
    codes: Counter[str]
    wrong: int  # OK answers with the wrong embedding
    admitted: Latencies  # the burst's OK requests
    refused: Latencies  # the burst's RESOURCE_EXHAUSTED requests
    burst_throughput: float  # requests answered OK per second during the burst
    closed_loop_p99: float
    # An admitted request waits for the batch computing when it came, for the inputs queued ahead of it, and
    # for its own batch: each at most a queue's worth, so 3 * max_queue_size / burst_throughput, plus the
    # closed-loop p99 for the rest of its path.
    bound: float
    after: list[float]  # throughput per 0.5 s window after the burst ends
    recovery: float | None  # seconds from the end of the burst to the first window at >= 80% of capacity
    client_codes: Counter[str] = field(default_factory=Counter)  # every call of the scenario, burst or not
    server_codes: dict[str, int] = field(default_factory=dict)  # the server's count of the same calls

    @property
    def lost(self) -> int:
        return self.sent - self.answered


def overload(
    address: str,
    request: Requests,
    *,
    max_queue_size: int,
    factor: float = 5.0,
    burst_seconds: float = 3.0,
    measure_seconds: float = 3.0,
    clients: int = 8,
    server_codes: Callable[[], dict[str, int]] | None = None,
) -> OverloadResult:
    channels = [grpc.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(4)]
    counted_before = server_codes() if server_codes else {}
    try:
        warm = closed_loop(channels, request, clients=clients, seconds=min(1.0, measure_seconds))
        before = closed_loop(channels, request, clients=clients, seconds=measure_seconds, start=10**6)
        ok_before = [c for c in before if c.code == OK]
        capacity = len(ok_before) / measure_seconds
        p99 = percentile([c.latency for c in ok_before], 99)
        rate = factor * capacity
        burst_start = time.monotonic()
        burst_calls: list[Call] = []
        sent_box: list[int] = []

        def burst() -> None:
            calls, sent = open_loop(channels, request, rate=rate, seconds=burst_seconds, start=2 * 10**6)
            burst_calls.extend(calls)
            sent_box.append(sent)

        sender = threading.Thread(target=burst, daemon=True)
        sender.start()
        time.sleep(burst_seconds)
        burst_end = time.monotonic()
        after_calls = closed_loop(channels, request, clients=clients, seconds=measure_seconds, start=3 * 10**6)
        sender.join(3 * WAIT)
        sent = sent_box[0] if sent_box else 0
    finally:
        for ch in channels:
            ch.close()
    after = windows(after_calls, burst_end, burst_end + measure_seconds)
    recovery = next((0.5 * (i + 1) for i, v in enumerate(after) if v >= 0.8 * capacity), None)
    codes = Counter(c.code for c in burst_calls)
    client_codes = Counter(c.code for c in warm + before + burst_calls + after_calls)
    if server_codes:  # the server counts a call just after answering it: give the last ones a moment
        with contextlib.suppress(TimeoutError):
            wait_until(
                lambda: sum(server_codes().values()) - sum(counted_before.values()) >= sum(client_codes.values()),
                "the server to count every call",
                5,
            )
    admitted = [c.latency for c in burst_calls if c.code == OK]
    span = max((c.done for c in burst_calls), default=burst_end) - burst_start
    throughput = len(admitted) / max(span, 1e-9)
    return OverloadResult(
        max_queue_size=max_queue_size,
        capacity=capacity,
        factor=factor,
        offered_rate=rate,
        sent_rate=sent / max(burst_end - burst_start, 1e-9),
        burst_seconds=burst_seconds,
        sent=sent,
        answered=len(burst_calls),
        codes=codes,
        wrong=sum(1 for c in burst_calls + before + after_calls if c.code == OK and not c.correct),
        admitted=Latencies.of(admitted),
        refused=Latencies.of([c.latency for c in burst_calls if c.code == "RESOURCE_EXHAUSTED"]),
        burst_throughput=throughput,
        closed_loop_p99=p99,
        bound=3 * max_queue_size / max(throughput, 1e-9) + p99,
        after=after,
        recovery=recovery,
        client_codes=client_codes,
        server_codes={k: v - counted_before.get(k, 0) for k, v in server_codes().items()} if server_codes else {},
    )
