"""Deadlines and cancellation: requests that expire or are cancelled while queued, and streams cancelled
with requests queued, never reach the model, are counted, and leave nothing behind (tasks, batcher
jobs and sequences, RPCs in flight, threads: counted before and after)."""

from __future__ import annotations

import dataclasses

import pytest

from mhaserve.loadtest.reliability.scenarios.deadlines import deadlines
from mhaserve.service.settings import Settings
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.server import ServerThread


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
    assert result.expired_codes == {"DEADLINE_EXCEEDED": result.expired_sent}
    assert result.cancelled_codes == {"CANCELLED": result.cancelled_sent}
    assert result.blockers_ok == result.cycles
    assert result.reached_model == 0, "an expired or cancelled request was computed"
    assert result.server_deadline_exceeded == result.expired_sent
    assert result.server_cancelled == result.cancelled_sent + result.streams_cancelled
    before, after = result.before, result.after
    assert before is not None and after is not None
    assert (after.jobs, after.seqs, after.depth, after.in_flight) == (0, 0, 0, 0)
    assert after.tasks <= before.tasks
    assert after.threads <= before.threads + 2  # grpc may keep a poller thread or two
