"""Deadlines and cancellation: requests that expire or are cancelled while queued, and streams cancelled
with requests queued, never reach the model, are counted, and leave nothing behind (tasks, batcher
jobs and sequences, RPCs in flight, threads: counted before and after)."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import time
from collections.abc import Iterator

import pytest

from mhaserve.loadtest.reliability.scenarios.common import HOLD
from mhaserve.loadtest.reliability.scenarios.deadlines import DeadlineResult, Footprint, deadlines
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service.settings import Settings
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.loopback import WAIT, wait_until
from mhaserve.testing.server import ServerThread


def _assert_all_dropped_and_counted(result: DeadlineResult) -> None:
    assert result.expired_codes == {"DEADLINE_EXCEEDED": result.expired_sent}
    assert result.cancelled_codes == {"CANCELLED": result.cancelled_sent}
    assert result.blockers_ok == result.cycles
    assert result.reached_model == 0, "an expired or cancelled request was computed"
    assert result.server_deadline_exceeded == result.expired_sent
    assert result.server_cancelled == result.cancelled_sent + result.streams_cancelled


def test_expired_and_cancelled_requests_are_dropped_before_inference_and_free_everything(
    settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = ScriptedEngine(hang_on=99)
    with ServerThread(dataclasses.replace(settings, max_wait_ms=0.0), engine.factory()) as srv:
        srv.ready()
        try:
            result = deadlines(srv, engine, cycles=3, per_cycle=10, streams=3)
        finally:
            engine.release.set()
    with capsys.disabled():
        print(f"\ndeadlines: {result}")
    _assert_all_dropped_and_counted(result)
    before, after = result.before, result.after
    assert before is not None and after is not None
    assert (after.jobs, after.seqs, after.depth, after.in_flight) == (0, 0, 0, 0)
    assert after.tasks <= before.tasks
    assert after.threads <= before.threads + 2  # grpc may keep a poller thread or two


def test_streams_cancelled_with_more_requests_than_their_window_compute_none_of_them(settings: Settings) -> None:
    """40 requests a stream, past its window of 32: the one that waited for room was started anyway, lost
    when the stream was cancelled, and reached the model once the held batch returned."""
    engine = ScriptedEngine(hang_on=99)
    with ServerThread(dataclasses.replace(settings, max_wait_ms=0.0), engine.factory()) as srv:
        srv.ready()
        try:
            result = deadlines(srv, engine, cycles=1, per_cycle=2, streams=2, per_stream=40)
        finally:
            engine.release.set()
    _assert_all_dropped_and_counted(result)
    assert result.after is not None and (result.after.jobs, result.after.depth) == (0, 0)


def test_the_footprint_counts_the_jobs_and_sequences_the_server_holds(settings: Settings) -> None:
    """The leak check can fail: it counted the batcher's classes by the names `_Job` and `_Seq` they had before
    a rename, saw none of either whatever the server held, and passed. Here one request of three inputs is queued
    behind a held one: two jobs, four sequences."""
    engine = ScriptedEngine(hang_on=HOLD)
    with ServerThread(dataclasses.replace(settings, max_wait_ms=0.0), engine.factory()) as srv:
        srv.ready()
        try:
            with srv.channel() as channel:
                stub = pb_grpc.EncoderServiceStub(channel)
                blocker = stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[HOLD, 5])]), timeout=WAIT)
                wait_until(engine.hanging.is_set, "the engine to hold the blocking batch")
                three = pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[20 + i]) for i in range(3)])
                queued = stub.Encode.future(three, timeout=WAIT)
                wait_until(lambda: srv.depth() == 3, "the request to be queued")
                held = Footprint.of(srv)
                engine.release.set()
                assert len(blocker.result().embeddings) == 1 and len(queued.result().embeddings) == 3
        finally:
            engine.release.set()
    assert (held.jobs, held.seqs, held.depth) == (2, 4, 3)


def _freeze(seconds: float, done: threading.Event) -> None:
    time.sleep(seconds)  # called on the server's loop: nothing of the server runs meanwhile
    done.set()


@contextlib.contextmanager
def _stalls(srv: ServerThread, seed: int) -> Iterator[None]:
    """The server's event loop frozen again and again, 50-400 ms at a time: what a loaded machine does to it."""
    rng = random.Random(seed)
    stop = threading.Event()

    def stall() -> None:
        while not stop.wait(rng.uniform(0.05, 0.3)):
            done = threading.Event()
            srv.loop.call_soon_threadsafe(_freeze, rng.uniform(0.05, 0.4), done)
            done.wait(WAIT)  # one at a time: piled up, they would leave a server that never runs

    thread = threading.Thread(target=stall, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(WAIT)


def test_the_counts_do_not_depend_on_how_fast_the_server_keeps_up(settings: Settings) -> None:
    """Under load the clients learn of a deadline or a cancellation before the server does. The scenario
    once went on regardless: it took requests the server had not yet dropped for the next phase's and
    cancelled that phase's requests before the server had them, which it then never counted
    (`26 == 30 + 9`). With the server's loop stalling throughout, every count must still hold."""
    engine = ScriptedEngine(hang_on=99)
    with ServerThread(dataclasses.replace(settings, max_wait_ms=0.0), engine.factory()) as srv:
        srv.ready()
        try:
            with _stalls(srv, seed=13):
                result = deadlines(srv, engine, cycles=2, per_cycle=10, streams=3)
        finally:
            engine.release.set()
    _assert_all_dropped_and_counted(result)
