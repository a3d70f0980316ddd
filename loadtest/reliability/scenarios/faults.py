"""Engine faults: a batch that raises, a batch that hangs past --inference-timeout, an engine stuck for good."""

from __future__ import annotations

import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from mhaserve.loadtest.reliability.scenarios.common import HOLD, OK, code_of
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.proto.inference.v2 import grpc_service_pb2 as kpb
from mhaserve.proto.inference.v2 import grpc_service_pb2_grpc as kpb_grpc
from mhaserve.testing.engines import ScriptedEngine, expected_row
from mhaserve.testing.loopback import WAIT, wait_until
from mhaserve.testing.process import ServerProcess
from mhaserve.testing.server import ServerThread, health_status

POISON = 13


@dataclass
class FaultResult:
    requests: int = 0
    poisoned: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    poisoned_codes: Counter[str] = field(default_factory=Counter)
    failed_without_poison: int = 0  # a request without the marker failed (its batch held one, or not)
    shared_with_poison: int = 0  # requests without the marker that shared a batch with one
    wrong: int = 0
    serving_after: bool = False
    hangs: int = 0
    hung_codes: Counter[str] = field(default_factory=Counter)  # the request in the stuck batch
    queued_codes: Counter[str] = field(default_factory=Counter)  # requests queued behind it
    refused_codes: Counter[str] = field(default_factory=Counter)  # requests sent while stuck
    health_while_stuck: Counter[str] = field(default_factory=Counter)
    recovered: int = 0
    hang_messages: set[str] = field(default_factory=set)


def engine_faults(
    srv: ServerThread, engine: ScriptedEngine, *, requests: int, poison_share: float = 0.1
) -> FaultResult:
    """Concurrent requests, some holding the token the engine raises on: those fail, each with INTERNAL, and
    every other request gets its right answer, even one that shared a batch with poison (the batcher runs the
    batch again without it); the server stays SERVING."""
    result = FaultResult(requests=requests)
    rng = random.Random(7)
    tags = [(20 + i % 200, 20 + i // 200 % 200) for i in range(requests)]
    poisoned = [rng.random() < poison_share for _ in range(requests)]
    result.poisoned = sum(poisoned)
    with srv.channel() as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        futures = []
        for (a, b), bad in zip(tags, poisoned, strict=True):
            ids = [POISON, a, b] if bad else [a, b, 5]
            futures.append(
                (
                    ids,
                    stub.Encode.future(
                        pb.EncodeRequest(token_ids=[pb.TokenIds(ids=ids)], normalize=False), timeout=WAIT
                    ),
                )
            )
        answers = [(ids, *code_of(f.result)) for ids, f in futures]
        # every batch has run: all answers are in
        beside_poison = {tuple(row) for batch in engine.batches if any(POISON in r for r in batch) for row in batch}
        for ids, code, response in answers:
            (result.poisoned_codes if POISON in ids else result.codes)[code] += 1
            if code == OK:
                result.wrong += list(response.embeddings[0].values) != expected_row(ids)
            if POISON not in ids:
                result.failed_without_poison += code != OK
                result.shared_with_poison += tuple(ids) in beside_poison
        result.serving_after = health_status(channel) == "SERVING"
        check = stub.Encode(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[7, 5])], normalize=False), timeout=WAIT)
        result.serving_after &= list(check.embeddings[0].values) == expected_row([7, 5])
    return result


def engine_hangs(
    srv: ServerThread, engine: ScriptedEngine, *, cycles: int, queued: int = 5, result: FaultResult | None = None
) -> FaultResult:
    """A batch that never returns (until released): past --inference-timeout its request and those queued
    behind fail with UNAVAILABLE, health says NOT_SERVING and still answers, new requests are refused at
    once; once the engine returns the server serves again."""
    result = result or FaultResult()
    with srv.channel() as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        inference = kpb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(cycles):
            engine.release.clear()
            hung = stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[HOLD, 5])]), timeout=WAIT)
            wait_until(engine.hanging.is_set, "the engine to hang")
            behind = [
                stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[30 + i, 5])]), timeout=WAIT)
                for i in range(queued)
            ]
            try:
                hung.result()
                result.hung_codes[OK] += 1
            except grpc.RpcError as e:
                result.hung_codes[e.code().name] += 1
                result.hang_messages.add(e.details() or "")
            for f in behind:
                result.queued_codes[code_of(f.result)[0]] += 1
            wait_until(lambda: health_status(channel) == "NOT_SERVING", "health to report NOT_SERVING")  # noqa: B023
            result.health_while_stuck[health_status(channel)] += 1
            ready = inference.ServerReady(kpb.ServerReadyRequest(), timeout=WAIT).ready
            result.health_while_stuck[f"ServerReady={ready}"] += 1
            result.health_while_stuck[f"mhaserve_ready={srv.gauge('mhaserve_ready'):g}"] += 1
            result.refused_codes[code_of(lambda: stub.Encode(pb.EncodeRequest(texts=["x"]), timeout=WAIT))[0]] += 1  # noqa: B023
            engine.release.set()
            wait_until(lambda: health_status(channel) == "SERVING", "health to report SERVING again")  # noqa: B023
            again = code_of(lambda: stub.Encode(pb.EncodeRequest(texts=["back"]), timeout=WAIT))[0]  # noqa: B023
            result.recovered += again == OK
            result.hangs += 1
    return result


@dataclass
class StuckExit:
    hung_code: str
    exit_code: int | None
    seconds: float


def stuck_engine_exit(proc: ServerProcess) -> StuckExit:
    """A fake server whose engine hangs for good (`hang:99`) with a short --inference-timeout: the request
    fails with UNAVAILABLE, and SIGTERM still ends the process (the stuck thread cannot hold its exit)."""
    address = proc.wait_serving()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        code, _ = code_of(lambda: stub.Encode(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[HOLD, 5])]), timeout=WAIT))
        wait_until(lambda: health_status(channel) == "NOT_SERVING", "NOT_SERVING")
    t = time.monotonic()
    proc.signal(signal.SIGTERM)
    try:
        exit_code: int | None = proc.wait(WAIT)
    except Exception:
        exit_code = None
    return StuckExit(code, exit_code, time.monotonic() - t)
