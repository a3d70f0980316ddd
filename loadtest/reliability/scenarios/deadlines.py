"""Deadlines and cancellation: requests that expire or are cancelled while queued behind a held batch, and
streams cancelled with requests queued."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from mhaserve.loadtest.reliability.scenarios.common import HOLD, OK, code_of
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service.batching.queue import Job, Seq
from mhaserve.service.rpc.streaming import WINDOW
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.loopback import WAIT, wait_until
from mhaserve.testing.server import ServerThread


def _live_jobs_and_seqs() -> tuple[int, int]:
    """The batcher's jobs and sequences alive in this process (after a collection). Counted by their classes, not
    their names: by the names they had before a rename (`_Job`, `_Seq`) it found none, whatever was held."""
    gc.collect()
    alive = Counter(map(type, gc.get_objects()))
    return alive[Job], alive[Seq]


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
        jobs, seqs = _live_jobs_and_seqs()
        return cls(
            tasks=srv.tasks(),
            jobs=jobs,
            seqs=seqs,
            in_flight=int(srv.gauge("mhaserve_requests_in_flight")),
            depth=srv.depth(),
            threads=threading.active_count(),
        )


@dataclass
class DeadlineResult:
    cycles: int
    deadline: float = 0.0  # seconds: the expiring requests' deadline (the last one, if retried)
    retried: int = 0  # expiring batches set aside and sent again: the server had not queued them in time
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
    set_aside: Counter[str] = field(default_factory=Counter)  # what the server counted of the retried batches
    before: Footprint | None = None
    after: Footprint | None = None


EXPIRED, CANCELLED, STREAMED = 201, 202, 203
ENCODE, ENCODE_STREAM = "encoder.v1.EncoderService/Encode", "encoder.v1.EncoderService/EncodeStream"
LONGEST_DEADLINE = 8.0  # seconds: past it, a server too slow to queue the expiring requests is reported as is


def _blocking_iterator(items: Sequence[pb.EncodeRequest], stop: threading.Event) -> Iterator[pb.EncodeRequest]:
    yield from items
    stop.wait(2 * WAIT)  # then stay open, idle, until the test cancels the stream


def _ended(srv: ServerThread) -> int:
    """The calls the server has finished as expired or cancelled, Encode and EncodeStream together."""
    return sum(srv.counted(code, m) for code in ("DEADLINE_EXCEEDED", "CANCELLED") for m in (ENCODE, ENCODE_STREAM))


def _settle(srv: ServerThread, queued: int, ended: int, what: str) -> None:
    """Wait until the server is done with every call sent so far: their queue slots freed, each one counted.

    A client learns of its own deadline or cancellation at once; the server only when the news reaches
    its loop (its copy of the deadline fires, or the RST_STREAM arrives), later on a busy machine. A
    phase that started before the server caught up would see the last phase's requests still queued,
    take them for its own, and cancel requests the server had not received yet, which it never counts.
    A shortfall that persists (a call the server lost) shows in the counts returned.
    """
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: srv.depth() == queued and _ended(srv) >= ended, f"the server to finish {what}")


def _expire(srv: ServerThread, stub: pb_grpc.EncoderServiceStub, queued: int, n: int, result: DeadlineResult) -> None:
    """`n` requests that expire while queued, every one of them in the server's queue before its deadline.

    One still on its way when it expires is dropped by gRPC before the service sees it, and never
    counted: an attempt whose requests the server (stalled on a busy machine) had not all queued within
    half their deadline proves nothing. It is set aside, what the server counted of it noted, and made
    again with twice the deadline.
    """
    while True:
        before = Counter({code: srv.counted(code) for code in ("DEADLINE_EXCEEDED", "CANCELLED")})
        expiring = [
            stub.Encode.future(
                pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[EXPIRED, 20 + i])]), timeout=result.deadline
            )
            for i in range(n)
        ]
        try:
            wait_until(lambda: srv.depth() >= queued + n, "the expiring requests to be queued", result.deadline / 2)
            held = True
        except TimeoutError:
            held = False
        codes = Counter(code_of(f.result)[0] for f in expiring)
        if held or result.deadline >= LONGEST_DEADLINE:
            result.expired_codes += codes
            result.expired_sent += n
            return
        with contextlib.suppress(TimeoutError):  # every call of the attempt that reached the server, finished
            wait_until(
                lambda: srv.depth() == queued and srv.gauge("mhaserve_requests_in_flight") <= 1,  # the blocker
                "the server to finish the expiring requests set aside",
            )
        after = Counter({code: srv.counted(code) for code in ("DEADLINE_EXCEEDED", "CANCELLED")})
        result.set_aside += after - before
        result.retried += 1
        result.deadline *= 2


def deadlines(
    srv: ServerThread,
    engine: ScriptedEngine,
    *,
    cycles: int,
    per_cycle: int = 20,
    streams: int = 4,
    per_stream: int = 3,
    deadline: float = 1.0,
) -> DeadlineResult:
    """Requests whose deadline passes while queued behind a held batch, requests cancelled while queued,
    and streams cancelled with requests queued: none may reach the model, all must be counted, and the
    server's tasks, jobs and threads must come back to where they were.

    What the server counts must not depend on how fast it keeps up with the clients: each phase of a
    cycle begins once the server is done with the last one, requests are cancelled once the server has
    queued them, and expiring requests count once the server queued them before their `deadline`
    (doubled until it did).
    """
    result = DeadlineResult(cycles=cycles, deadline=deadline)
    with srv.channel() as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        stub.Encode(pb.EncodeRequest(texts=["warm"]), timeout=WAIT)
        result.before = Footprint.of(srv)
        baseline = _ended(srv)

        def ended() -> int:  # what the server must have counted as expired or cancelled by now
            sent = result.expired_sent + result.cancelled_sent + result.streams_cancelled
            return baseline + result.set_aside.total() + sent

        for _ in range(cycles):
            engine.release.clear()
            blocker = stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[HOLD, 5])]), timeout=WAIT)
            wait_until(engine.hanging.is_set, "the engine to hold the blocking batch")
            queued = srv.depth()

            _expire(srv, stub, queued, per_cycle, result)
            _settle(srv, queued, ended(), "the expired requests")

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
            _settle(srv, queued, ended(), "the cancelled requests")

            stop = threading.Event()
            open_streams = []
            for s in range(streams):
                items = [
                    pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[STREAMED, 20 + s, 20 + k])]) for k in range(per_stream)
                ]
                open_streams.append(stub.EncodeStream(_blocking_iterator(items, stop), timeout=WAIT))
                result.stream_requests += len(items)
            # A stream computes up to its window at once; past it, the rest waits in the stream (and must not
            # reach the model either once the stream is cancelled).
            in_window = min(per_stream, WINDOW) * streams
            wait_until(lambda: srv.depth() >= queued + in_window, "the streams' requests to be queued")  # noqa: B023
            for st in open_streams:
                st.cancel()
            stop.set()
            result.streams_cancelled += streams
            _settle(srv, queued, ended(), "the cancelled streams")

            engine.release.set()
            result.blockers_ok += code_of(lambda: blocker.result(timeout=WAIT))[0] == OK  # noqa: B023
        wait_until(lambda: srv.depth() == 0, "the queue to empty")
        result.reached_model = sum(engine.seen(t) for t in (EXPIRED, CANCELLED, STREAMED))
        wait_until(lambda: srv.tasks() <= result.before.tasks, "the server's tasks to end", 10)  # type: ignore[union-attr]
        result.server_deadline_exceeded = srv.counted("DEADLINE_EXCEEDED") - result.set_aside["DEADLINE_EXCEEDED"]
        cancelled_streams = srv.counted("CANCELLED", ENCODE_STREAM)
        result.server_cancelled = srv.counted("CANCELLED") - result.set_aside["CANCELLED"] + cancelled_streams
        result.after = Footprint.of(srv)
    return result
