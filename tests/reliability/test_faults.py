"""Faults: an engine that raises fails only its batch's requests; one that hangs past --inference-timeout
fails them with UNAVAILABLE, health says NOT_SERVING (and keeps answering), and when it returns the
server serves again. A process whose engine stays stuck still exits on SIGTERM."""

from __future__ import annotations

import dataclasses

import pytest

from mhaserve.loadtest.reliability.scenarios.faults import POISON, engine_faults, engine_hangs, stuck_engine_exit
from mhaserve.service.settings import Settings
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.server import ServerThread
from tests.reliability.conftest import Spawn


def test_an_engine_error_fails_only_the_batches_it_hit(settings: Settings) -> None:
    engine = ScriptedEngine(fail_on=POISON, seconds_per_batch=0.002)
    with ServerThread(dataclasses.replace(settings, max_wait_ms=2.0), engine.factory()) as srv:
        srv.ready()
        result = engine_faults(srv, engine, requests=300, poison_share=0.1)
    assert result.poisoned > 0
    assert result.poisoned_codes == {"INTERNAL": result.poisoned}
    assert set(result.codes) <= {"OK", "INTERNAL"} and result.codes["OK"] > 0
    assert result.failed_without_poison_in_batch == 0
    assert result.wrong == 0
    assert result.serving_after


def test_a_hung_engine_is_reported_and_the_server_recovers(settings: Settings) -> None:
    engine = ScriptedEngine(hang_on=99)
    with ServerThread(dataclasses.replace(settings, inference_timeout=0.3, max_wait_ms=0.0), engine.factory()) as srv:
        srv.ready()
        try:
            result = engine_hangs(srv, engine, cycles=2, queued=4)
        finally:
            engine.release.set()
    assert result.hung_codes == {"UNAVAILABLE": 2}
    assert result.queued_codes == {"UNAVAILABLE": 8}
    assert result.refused_codes == {"UNAVAILABLE": 2}
    assert result.health_while_stuck == {"NOT_SERVING": 2, "ServerReady=False": 2}
    assert result.recovered == 2
    (message,) = result.hang_messages
    assert "more than 0.3 s (--inference-timeout)" in message and "NOT_SERVING" in message


@pytest.mark.slow
def test_a_process_with_a_stuck_engine_still_exits_on_sigterm(spawn: Spawn) -> None:
    proc = spawn("--inference-timeout", "0.5", "--grace-period", "5", engine="hang:99")
    result = stuck_engine_exit(proc)
    assert result.hung_code == "UNAVAILABLE"
    assert result.exit_code == 1, proc.log
    assert "inference call still stuck" in proc.log
