"""Overload: an open-loop burst at several times the capacity of an engine with a known cost per batch.

The excess is refused with RESOURCE_EXHAUSTED, every admitted request gets its right answer, none is
lost, the server's counts match the client's, and closed-loop requests afterwards are all answered.
Latencies are reported, not asserted (the machine is shared); `make reliability` states them against
the queue bound.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from mhaserve.loadtest.reliability.scenarios.common import code_of
from mhaserve.loadtest.reliability.scenarios.load import scripted_requests
from mhaserve.loadtest.reliability.scenarios.overload import overload
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service.settings import Settings
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.loopback import WAIT, wait_until
from mhaserve.testing.server import ServerThread

ENCODE = "encoder.v1.EncoderService/Encode"


@pytest.mark.slow
def test_a_burst_past_capacity_is_refused_not_queued_and_nothing_admitted_is_lost(
    settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    # 50 ms per batch of at most 4 inputs of 8 tokens: about 80 requests/s, whatever the machine.
    engine = ScriptedEngine(seconds_per_batch=0.05, record=False)
    queue = 16
    limited = dataclasses.replace(
        settings, max_batch_tokens=32, max_queue_size=queue, max_client_batch_size=4, max_wait_ms=2.0
    )
    with ServerThread(limited, engine.factory()) as srv:
        srv.ready()

        def server_codes() -> dict[str, int]:
            return {code: srv.counted(code) for code in ("OK", "RESOURCE_EXHAUSTED")}

        result = overload(
            srv.address,
            scripted_requests(),
            max_queue_size=queue,
            factor=5.0,
            burst_seconds=2.0,
            measure_seconds=1.5,
            clients=8,
        )
        wait_until(lambda: srv.depth() == 0, "the queue to empty")
        total = sum(result.codes.values())
        wait_until(lambda: sum(server_codes().values()) >= total, "the server to count every call", 10)
    with capsys.disabled():
        print(
            f"\noverload: capacity {result.capacity:.0f} req/s, burst {result.sent} sent at {result.sent_rate:.0f}/s "
            f"({result.factor:g}x offered), codes {dict(result.codes)}, admitted p99 {result.admitted.p99 * 1000:.0f} "
            f"ms (bound {result.bound * 1000:.0f} ms), refused p99 {result.refused.p99 * 1000:.1f} ms"
        )
    assert result.capacity > 0
    assert result.lost == 0, "a request never got an answer"
    assert set(result.codes) <= {"OK", "RESOURCE_EXHAUSTED"}
    assert result.codes["RESOURCE_EXHAUSTED"] > 0 and result.codes["OK"] > 0
    assert result.wrong == 0, "an admitted request got another request's answer"
    # Afterwards the server serves again: the closed loop after the burst got answers.
    assert sum(result.after) > 0


@pytest.mark.parametrize("front", ["grpc", "lean"])
def test_a_flood_of_concurrent_calls_gets_meaningful_codes_never_cancelled(settings: Settings, front: str) -> None:
    """5000 calls at once on one connection, faster than the event loop takes them: gRPC's own backlog limit
    would answer part of them CANCELLED; the server leaves the decision to its queue limit instead.

    grpc core also counts a call against the stream limit until grpc.aio has released it, a turn of the loop or
    more after its trailers went out (its defence against rapid resets, kept): on a busy host it refuses calls
    that a client keeping the limit opened meanwhile (REFUSED_STREAM: never seen by the service, read as
    UNAVAILABLE, safe to retry). The lean front counts a call until it has answered, and refuses none."""
    engine = ScriptedEngine(seconds_per_batch=0.002, record=False)
    flood = dataclasses.replace(settings, max_queue_size=256, max_client_batch_size=4, grpc_front=front)
    with ServerThread(flood, engine.factory()) as srv:
        srv.ready()
        request = scripted_requests()
        with srv.channel() as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            calls = [request(i) for i in range(5000)]
            futures = [(stub.Encode.future(req, timeout=2 * WAIT), check) for req, check in calls]
            codes: Counter[str] = Counter()
            for future, check in futures:
                code, response = code_of(lambda f=future: f.result())  # type: ignore[misc]
                if code == "UNAVAILABLE" and "RST_STREAM with error code 7" in future.details():
                    code = "REFUSED_STREAM"
                codes[code if code != "OK" or check(response) else "wrong"] += 1
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED", *(["REFUSED_STREAM"] if front == "grpc" else [])}, codes
    assert sum(codes.values()) == 5000
