"""Deadlines and cancellation: requests that expire or are cancelled while queued behind a held batch, and
streams cancelled with requests queued."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from mhaserve.loadtest.reliability.scenarios.common import HOLD, OK, code_of
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.loopback import WAIT, wait_until
from mhaserve.testing.process import live_objects
from mhaserve.testing.server import ServerThread


@dataclass(frozen=True)
class Footprint:
    """What a server holds: asyncio tasks, batcher jobs and sequences, RPCs in flight, queue depth, threads."""

    tasks: int
    jobs: int
    seqs: int
    in_flight: int
    depth: int
    threads: int

    @classmethod
    def of(cls, srv: ServerThread) -> Footprint:
        objects = live_objects("_Job", "_Seq")
        return cls(
            tasks=srv.tasks(),
            jobs=objects["_Job"],
            seqs=objects["_Seq"],
            in_flight=int(srv.gauge("mhaserve_requests_in_flight")),
            depth=srv.depth(),
            threads=threading.active_count(),
        )


@dataclass
class DeadlineResult:
    cycles: int
    expired_sent: int = 0
    expired_codes: Counter[str] = field(default_factory=Counter)
    cancelled_sent: int = 0
    cancelled_codes: Counter[str] = field(default_factory=Counter)
    streams_cancelled: int = 0
    stream_requests: int = 0
    blockers_ok: int = 0
    reached_model: int = 0  # inputs of expired, cancelled or stream-cancelled requests the engine saw
    server_deadline_exceeded: int = 0
    server_cancelled: int = 0
    before: Footprint | None = None
    after: Footprint | None = None


EXPIRED, CANCELLED, STREAMED = 201, 202, 203


def _blocking_iterator(items: Sequence[pb.EncodeRequest], stop: threading.Event) -> Iterator[pb.EncodeRequest]:
    yield from items
    stop.wait(2 * WAIT)  # then stay open, idle, until the test cancels the stream


def deadlines(
    srv: ServerThread, engine: ScriptedEngine, *, cycles: int, per_cycle: int = 20, streams: int = 4
) -> DeadlineResult:
    """Requests whose deadline passes while queued behind a held batch, requests cancelled while queued,
    and streams cancelled with requests queued: none may reach the model, all must be counted, and the
    server's tasks, jobs and threads must come back to where they were."""
    result = DeadlineResult(cycles=cycles)
    with srv.channel() as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        stub.Encode(pb.EncodeRequest(texts=["warm"]), timeout=WAIT)
        result.before = Footprint.of(srv)
        for _ in range(cycles):
            engine.release.clear()
            blocker = stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[HOLD, 5])]), timeout=WAIT)
            wait_until(engine.hanging.is_set, "the engine to hold the blocking batch")
            queued = srv.depth()
            expiring = [
                stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[EXPIRED, 20 + i])]), timeout=0.3)
                for i in range(per_cycle)
            ]
            result.expired_sent += len(expiring)
            for f in expiring:
                result.expired_codes[code_of(f.result)[0]] += 1
            cancelled = [
                stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[CANCELLED, 20 + i])]), timeout=WAIT)
                for i in range(per_cycle)
            ]
            wait_until(lambda: srv.depth() >= queued + per_cycle, "the requests to cancel to be queued")  # noqa: B023
            for f in cancelled:
                f.cancel()
            for f in cancelled:
                result.cancelled_codes[code_of(f.result)[0]] += 1
            result.cancelled_sent += len(cancelled)
            stop = threading.Event()
            open_streams = []
            for s in range(streams):
                items = [pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[STREAMED, 20 + s, 20 + k])]) for k in range(3)]
                open_streams.append(stub.EncodeStream(_blocking_iterator(items, stop), timeout=WAIT))
                result.stream_requests += len(items)
            wait_until(lambda: srv.depth() >= queued + 3 * streams, "the streams' requests to be queued")  # noqa: B023
            for st in open_streams:
                st.cancel()
            stop.set()
            result.streams_cancelled += streams
            wait_until(lambda: srv.depth() == queued, "the cancelled streams to free their slots")  # noqa: B023
            engine.release.set()
            result.blockers_ok += code_of(lambda: blocker.result(timeout=WAIT))[0] == OK  # noqa: B023
        wait_until(lambda: srv.depth() == 0, "the queue to empty")
        result.reached_model = sum(engine.seen(t) for t in (EXPIRED, CANCELLED, STREAMED))
        wait_until(lambda: srv.tasks() <= result.before.tasks, "the server's tasks to end", 10)  # type: ignore[union-attr]
        # The interceptor counts a call after its status has gone out: give the last counts a moment to land
        # (a shortfall that persists still fails the check).
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: srv.counted("DEADLINE_EXCEEDED") >= result.expired_sent, "deadlines counted", 5)
        result.server_deadline_exceeded = srv.counted("DEADLINE_EXCEEDED")

        def cancels() -> int:
            return srv.counted("CANCELLED") + srv.counted("CANCELLED", "encoder.v1.EncoderService/EncodeStream")

        with contextlib.suppress(TimeoutError):
            expected = result.cancelled_sent + result.streams_cancelled
            wait_until(lambda: cancels() >= expected, "cancellations counted", 5)
        result.server_cancelled = cancels()
        result.after = Footprint.of(srv)
    return result
