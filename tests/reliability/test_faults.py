"""Faults: an engine that raises on an input fails only that input's request; one that hangs past --inference-timeout
fails them with UNAVAILABLE, health says NOT_SERVING (and keeps answering), and when it returns the
server serves again. A process whose engine stays stuck still exits on SIGTERM."""

from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import signal
import time
from pathlib import Path

import grpc
import pytest

from mhaserve.loadtest.reliability.scenarios.faults import POISON, engine_faults, engine_hangs, stuck_engine_exit
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.proto.inference.v2 import grpc_service_pb2 as kpb
from mhaserve.proto.inference.v2 import grpc_service_pb2_grpc as kpb_grpc
from mhaserve.service.settings import Settings
from mhaserve.testing import http
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.loopback import WAIT, free_port, wait_until
from mhaserve.testing.metrics import scrape
from mhaserve.testing.process import ServerProcess
from mhaserve.testing.server import ServerThread, health_status
from tests.reliability.conftest import Spawn, tiny_flags
from tests.service.test_models import copy_version


def test_an_engine_error_fails_only_the_requests_whose_input_it_raised_on(settings: Settings) -> None:
    """Before, it failed every request in the batch: half the innocent requests of a reliability run."""
    engine = ScriptedEngine(fail_on=POISON, seconds_per_batch=0.002)
    with ServerThread(dataclasses.replace(settings, max_wait_ms=2.0), engine.factory()) as srv:
        srv.ready()
        result = engine_faults(srv, engine, requests=300, poison_share=0.1)
    assert result.poisoned > 0
    assert result.poisoned_codes == {"INTERNAL": result.poisoned}
    assert result.shared_with_poison > 0  # the check below is not empty
    assert result.codes == {"OK": result.requests - result.poisoned}
    assert result.failed_without_poison == 0
    assert result.wrong == 0
    assert result.serving_after


def test_a_hung_engine_is_reported_and_the_server_recovers(settings: Settings) -> None:
    engine = ScriptedEngine(hang_on=99)
    with ServerThread(dataclasses.replace(settings, inference_timeout=0.3, max_wait_ms=0.0), engine.factory()) as srv:
        srv.ready()
        assert srv.gauge("mhaserve_ready") == 1
        batches = srv.gauge("mhaserve_inference_duration_seconds_count")
        try:
            result = engine_hangs(srv, engine, cycles=2, queued=4)
        finally:
            engine.release.set()
        # Prometheus sees the stalls, and the stalled batches' time once they return (2 of them, and the 2
        # requests that found the server back); the queued requests never ran.
        assert srv.gauge("mhaserve_inference_stalls_total") == 2
        wait_until(
            lambda: srv.gauge("mhaserve_inference_duration_seconds_count") - batches == 4, "the 4 batches observed"
        )
        assert srv.gauge("mhaserve_inference_duration_seconds_sum") > 2 * 0.3
        assert srv.gauge("mhaserve_ready") == 1
    assert result.hung_codes == {"UNAVAILABLE": 2}
    assert result.queued_codes == {"UNAVAILABLE": 8}
    assert result.refused_codes == {"UNAVAILABLE": 2}
    assert result.health_while_stuck == {"NOT_SERVING": 2, "ServerReady=False": 2, "mhaserve_ready=0": 2}
    assert result.recovered == 2
    (message,) = result.hang_messages
    assert "more than 0.3 s (--inference-timeout)" in message and "NOT_SERVING" in message


def test_a_hung_engine_fails_what_other_models_queued_on_the_same_thread(settings: Settings, tmp_path: Path) -> None:
    """Two models, one inference thread: model a's engine hangs. Its batcher failed its own queue; model b's
    request, waiting for the same thread, waited until its deadline (for ever over HTTP): the hang Infinity
    has and mhaserve says it has not. So did a request for b that came past the server's gate before the stall
    and reached b's batcher after it: a stream's next message (a body still arriving too, or any request in
    --drain-delay), which waited for the hung engine; it is refused as b's queue was failed."""
    repo = tmp_path / "repo"
    for name in ("a", "b"):
        shutil.copytree(settings.repository / "tiny", repo / name)
    engine = ScriptedEngine(hang_on=99)
    two = dataclasses.replace(
        settings, repository=repo, model=("a", "b"), inference_workers=1, inference_timeout=0.5, max_wait_ms=0.0
    )
    with ServerThread(two, engine.factory()) as srv, srv.ready().channel() as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        outgoing: queue.Queue[pb.EncodeRequest | None] = queue.Queue()
        stream = stub.EncodeStream(iter(outgoing.get, None), timeout=WAIT)
        outgoing.put(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[7])], model="b"))
        assert next(stream).embeddings  # the stream is open, past the gate, before the stall
        try:
            hung = stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[99, 5])], model="a"), timeout=WAIT)
            assert engine.hanging.wait(WAIT)
            started = time.monotonic()
            waiting = stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[7])], model="b"), timeout=WAIT)
            for call in (hung, waiting):
                error = call.exception(WAIT)
                assert isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.UNAVAILABLE, error
            assert time.monotonic() - started < WAIT / 2  # at the watchdog's bound, not the deadline's
            assert "every inference thread is held" in str(waiting.exception().details())
            started = time.monotonic()
            outgoing.put(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[7])], model="b"))
            with pytest.raises(grpc.RpcError) as e:  # the server stalled: the stream ends, saying so
                next(stream)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
            assert "every inference thread is held" in str(e.value.details())
            assert time.monotonic() - started < WAIT / 2  # refused, not answered once the engine returned
        finally:
            outgoing.put(None)
            engine.release.set()
        wait_until(lambda: health_status(channel) == "SERVING", "the server to recover")
        assert stub.Encode(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[7])], model="b"), timeout=WAIT).embeddings


def test_a_version_loaded_while_the_threads_stall_serves_once_they_return(settings: Settings) -> None:
    """The recovery the README describes: the operator loads the stalled model again, and the engine returns
    while the new version warms up. Made during the stall, its batcher was marked refusing, and the engine's
    return cleared only the versions then served: the new one refused every call for good, health SERVING."""
    engine = ScriptedEngine(hang_on=99, gates=[1])  # the warm-up's inputs are all ones
    engine.gates[1].set()
    explicit = dataclasses.replace(settings, inference_timeout=0.3, max_wait_ms=0.0, model_control="explicit")
    with ServerThread(explicit, engine.factory()) as srv, srv.ready().channel() as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        try:
            hung = stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[99, 5])]), timeout=WAIT)
            error = hung.exception(WAIT)
            assert isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.UNAVAILABLE, error
            kserve.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name="tiny"), timeout=WAIT)
            engine.gates[1].clear()  # the new version's warm-up waits
            engine.batches.clear()
            load = kserve.RepositoryModelLoad.future(kpb.RepositoryModelLoadRequest(model_name="tiny"), timeout=WAIT)
            wait_until(lambda: engine.seen(1), "the new version's warm-up")
            engine.release.set()  # the stalled batch returns while it warms up
            wait_until(lambda: health_status(channel) == "SERVING", "the stall to end")
        finally:
            engine.release.set()
            engine.gates[1].set()
        load.result(WAIT)
        assert stub.Encode(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[7])]), timeout=WAIT).embeddings


@pytest.mark.slow
def test_a_process_with_a_stuck_engine_still_exits_on_sigterm(spawn: Spawn) -> None:
    proc = spawn("--inference-timeout", "0.5", "--grace-period", "5", engine="hang:99")
    result = stuck_engine_exit(proc)
    assert result.hung_code == "UNAVAILABLE"
    assert result.exit_code == 1, proc.log
    assert "inference call still running" in proc.log


@pytest.mark.slow
@pytest.mark.parametrize("held", ["read", "load"])
def test_a_process_with_a_repository_read_or_a_load_stalled_still_exits_on_sigterm(
    tiny_repo: Path, tmp_path: Path, held: str
) -> None:
    """A read of the repository, or a load's check of its version (every file of it read), held up by its file
    system (a network file system that stalls) runs in a thread that the interpreter's exit joins: SIGTERM
    drained the server, and the process then waited for the read for ever. A FIFO holds a read as such a file
    system would (an open waits for a writer, here none): as a model's serving.json, the plan's read; as a
    version's manifest.json, the load's check (the plan only looks at it). The log's word that a read or a load
    was left running says it was held when the server stopped."""
    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)
    if held == "read":
        (repo / "held" / "1").mkdir(parents=True)
        os.mkfifo(repo / "held" / "serving.json")
    else:
        shutil.copytree(repo / "tiny" / "1", repo / "held" / "1")
        (repo / "held" / "1" / "manifest.json").unlink()
        os.mkfifo(repo / "held" / "1" / "manifest.json")
    metrics = free_port()
    flags = tiny_flags(repo, "--model-control", "explicit", "--grace-period", "1", metrics_port=metrics)
    proc = ServerProcess(flags, tmp_path / "server.log")
    try:
        with grpc.insecure_channel(proc.wait_serving()) as channel:
            kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
            load = kserve.RepositoryModelLoad.future(kpb.RepositoryModelLoadRequest(model_name="held"), timeout=WAIT)

            def asked() -> bool:
                if held == "read":
                    return scrape(metrics).get("mhaserve_requests_in_flight") == 1
                index = kserve.RepositoryIndex(kpb.RepositoryIndexRequest(), timeout=WAIT)
                return any(m.name == "held" and m.state == "LOADING" for m in index.models)  # its check begun

            wait_until(asked, "the load asked for")
            proc.signal(signal.SIGTERM)
            assert proc.wait(WAIT) == 0, proc.log
            assert load.exception(WAIT) is not None  # answered, not left hanging
    finally:
        proc.kill()
    assert ("1 read of the model repository" if held == "read" else "1 step of a load") in proc.log


@pytest.mark.slow
def test_a_batch_still_computing_when_the_grace_period_ends_does_not_hold_the_exit(spawn: Spawn) -> None:
    """The watchdog's bound (60 s) is past the grace period (1 s): stopping cancelled the watchdog, so the
    call was never seen as stuck, and the interpreter's exit waited for the engine for ever."""
    metrics = free_port()
    proc = spawn("--inference-timeout", "60", "--grace-period", "1", engine="hang:99", metrics_port=metrics)
    address = proc.wait_serving()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        held = stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[99, 5])]), timeout=WAIT)
        wait_until(lambda: scrape(metrics).get("mhaserve_requests_in_flight") == 1, "the held request")
        proc.signal(signal.SIGTERM)
        assert proc.wait(WAIT) == 1, proc.log
        assert held.exception(WAIT) is not None  # answered (UNAVAILABLE), not left hanging
    assert "inference call still running" in proc.log


def test_a_stalled_version_replaced_while_its_engine_hangs_lets_the_server_serve_once_the_engine_returns(
    settings: Settings, tmp_path: Path
) -> None:
    """A version whose batch stalled, retired while its engine still hangs (a fixed version published, or the
    model unloaded and loaded again): its batcher was closed with the stalled batch's worker cancelled, so the
    server never heard that the batch returned, and stayed NOT_SERVING, refusing every request, for good."""
    repo = tmp_path / "repo"
    shutil.copytree(settings.repository / "tiny", repo / "tiny")
    engine = ScriptedEngine(hang_on=99)
    polled = dataclasses.replace(
        settings, repository=repo, inference_timeout=0.3, max_wait_ms=0.0, model_control="poll", repository_poll_s=0.1
    )
    with ServerThread(polled, engine.factory()) as srv, srv.ready().channel() as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        try:
            stall(stub)
            assert health_status(channel) == "NOT_SERVING"
            copy_version(repo, "tiny", 1, 2)
            # version 2 serves, and version 1, which holds no request (the stalled one was answered), is closed
            wait_until(lambda: srv.server.dataplane.versions("tiny") == [2], "version 2 served")
            wait_until(lambda: len(srv.server.manager.pipelines()) == 1, "version 1 closed")
        finally:
            engine.release.set()
        wait_until(lambda: health_status(channel) == "SERVING", "the server to serve again")
        assert stub.Encode(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[7])]), timeout=WAIT).model_version == 2
        assert srv.gauge("mhaserve_ready") == 1


def test_the_repository_api_answers_while_a_model_is_stalled(settings: Settings) -> None:
    """Loading a stalled model again (or unloading it) is what an operator does about it; the repository API was
    refused like the model calls ("the model is not responding"), over gRPC and HTTP. Model calls are still
    refused while the batch stalls, and the server serves again once the engine returns."""
    engine = ScriptedEngine(hang_on=99)
    explicit = dataclasses.replace(
        settings, inference_timeout=0.3, max_wait_ms=0.0, model_control="explicit", http_port=free_port()
    )
    with ServerThread(explicit, engine.factory()) as srv, srv.ready().channel() as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        try:
            stall(stub)
            with pytest.raises(grpc.RpcError) as refused:  # model calls: refused while it stalls
                stub.Encode(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[7])]), timeout=WAIT)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            index = kserve.RepositoryIndex(kpb.RepositoryIndexRequest(), timeout=WAIT)
            assert [(m.name, m.state) for m in index.models] == [("tiny", "READY")]
            reply = http.request("POST", f"{srv.http_url}/v2/repository/index", body=b"{}")
            assert reply.status == 200 and reply.json()[0]["state"] == "READY"
            kserve.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name="tiny"), timeout=WAIT)
            assert http.request("POST", f"{srv.http_url}/v2/repository/models/tiny/load", body=b"{}").status == 200
            assert health_status(channel) == "NOT_SERVING"  # the stalled batch still holds the thread
        finally:
            engine.release.set()
        wait_until(lambda: health_status(channel) == "SERVING", "the server to serve again")
        assert stub.Encode(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[7])]), timeout=WAIT).embeddings


def stall(stub: pb_grpc.EncoderServiceStub) -> None:
    """A request whose batch hangs on the engine (token 99) past the inference timeout: UNAVAILABLE."""
    hung = stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[99, 5])]), timeout=WAIT)
    error = hung.exception(WAIT)
    assert isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.UNAVAILABLE, error
