"""Shutdown: SIGTERM under load (drain: nothing accepted is lost), and a second signal that ends the drain."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass

import grpc

from mhaserve.loadtest.reliability.scenarios.common import HOLD, OK
from mhaserve.loadtest.reliability.scenarios.load import Call, Requests
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service.client import CHANNEL_OPTIONS
from mhaserve.testing.loopback import WAIT, wait_until
from mhaserve.testing.metrics import scrape
from mhaserve.testing.process import ServerProcess

ENCODE_OK = "encoder.v1.EncoderService/Encode OK "  # the server's debug line for an answered Encode


@dataclass
class ShutdownResult:
    signal: str
    clients: int
    sent: int
    codes: Counter[str]
    in_flight_at_signal: int  # requests sent before the signal and answered after it
    in_flight_ok: int
    in_flight_refused: int  # of those, refused at the door: they reached the server after the drain began
    unavailable: Counter[str]  # why: refused while draining, or no server to connect to
    # CANCELLED can only come from gRPC itself, for a call that reached the server as it stopped accepting
    # (grpc/grpc#41785): never from the service. Those sent before the signal would be losses:
    cancelled_sent_before_signal: int
    exit_code: int | None
    exit_seconds: float  # from the signal to the process's exit
    # From the server's own log (--log-level debug): calls it answered OK, and calls it saw cancelled.
    server_ok: int | None = None
    server_cancelled: int | None = None


def shutdown_under_load(
    proc: ServerProcess, request: Requests, *, clients: int = 8, load_seconds: float = 2.0, sig: int = signal.SIGTERM
) -> ShutdownResult:
    """Closed-loop load, then a signal: every request sent must get OK or UNAVAILABLE (refused, never
    accepted and dropped), those in flight at the signal OK, and the exit status must be 0."""
    address = proc.address()
    calls: list[tuple[Call, str]] = []
    lock = threading.Lock()
    stop = threading.Event()
    counter = iter(range(10**9))
    ok_logged_before = proc.log.count(ENCODE_OK)  # e.g. the reference requests of `request`

    def client(k: int) -> None:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            while not stop.is_set():
                with lock:
                    i = next(counter)
                req, check = request(i)
                t = time.monotonic()
                try:
                    response = stub.Encode(req, timeout=WAIT)
                    call, details = Call(t, time.monotonic(), OK, check(response)), ""
                except grpc.RpcError as e:
                    call, details = Call(t, time.monotonic(), e.code().name, False), e.details() or ""
                with lock:
                    calls.append((call, details))
                if call.code == "UNAVAILABLE" and "shutting down" not in details:
                    return  # the server is gone

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    time.sleep(load_seconds)
    signalled = time.monotonic()
    proc.signal(signal.Signals(sig))
    try:
        exit_code: int | None = proc.wait(2 * WAIT)
    except Exception:
        exit_code = None
    exited = time.monotonic()
    stop.set()
    for t in threads:
        t.join(WAIT)
    in_flight = [(c, details) for c, details in calls if c.sent < signalled <= c.done]
    unavailable: Counter[str] = Counter()
    for c, details in calls:
        if c.code == "UNAVAILABLE":
            unavailable["refused: shutting down" if "shutting down" in details else "no server (connection)"] += 1
    log = proc.log
    logged = ENCODE_OK in log
    return ShutdownResult(
        signal=signal.Signals(sig).name,
        clients=clients,
        sent=len(calls),
        codes=Counter(c.code if c.code != OK or c.correct else "OK (wrong answer)" for c, _ in calls),
        in_flight_at_signal=len(in_flight),
        in_flight_ok=sum(1 for c, _ in in_flight if c.code == OK and c.correct),
        in_flight_refused=sum(1 for c, d in in_flight if c.code == "UNAVAILABLE" and "shutting down" in d),
        unavailable=unavailable,
        cancelled_sent_before_signal=sum(1 for c, _ in calls if c.code == "CANCELLED" and c.sent < signalled),
        exit_code=exit_code,
        exit_seconds=exited - signalled,
        server_ok=log.count(ENCODE_OK) - ok_logged_before if logged else None,
        server_cancelled=log.count("encoder.v1.EncoderService/Encode CANCELLED ") if logged else None,
    )


@dataclass
class ForcedExit:
    signals: str
    exit_code: int | None
    after_first_still_running: bool
    seconds_after_second: float


def second_signal(proc: ServerProcess, metrics_port: int, *, sig: int = signal.SIGTERM) -> ForcedExit:
    """A request held in the engine (fake server, `hang:99`, no watchdog), a signal (the drain waits for
    it), then a second signal: the process must exit at once with 128 + the signal's number."""
    address = proc.wait_serving()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        held = stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[HOLD, 5])]), timeout=WAIT)
        wait_until(lambda: scrape(metrics_port).get("mhaserve_requests_in_flight") >= 1, "the request in flight")
        proc.signal(signal.Signals(sig))
        wait_until(lambda: "shutting down" in proc.log, "the drain to begin")
        time.sleep(0.5)
        still_running = proc.proc.poll() is None
        t = time.monotonic()
        proc.signal(signal.Signals(sig))
        try:
            code: int | None = proc.wait(WAIT)
        except Exception:
            code = None
        held.cancel()
    return ForcedExit(f"{signal.Signals(sig).name} twice", code, still_running, time.monotonic() - t)
