"""The load the scenarios put on a server: closed and open loops of calls, and the requests they send
(each checked against its own right answer)."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from mhaserve.loadtest.reliability.scenarios.common import OK, code_of
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service.client import CHANNEL_OPTIONS
from mhaserve.testing.engines import expected_row
from mhaserve.testing.loopback import WAIT, wait_until


@dataclass(frozen=True)
class Call:
    """One request: when it was sent and answered (monotonic seconds), its code, and whether it was right."""

    sent: float
    done: float
    code: str
    correct: bool

    @property
    def latency(self) -> float:
        return self.done - self.sent


# request(i) -> the i-th request and a check of its response
Requests = Callable[[int], tuple[pb.EncodeRequest, Callable[[pb.EncodeResponse], bool]]]


def closed_loop(
    channels: Sequence[grpc.Channel], request: Requests, *, clients: int, seconds: float, start: int = 0
) -> list[Call]:
    """`clients` threads, each sending its next request when the previous one is answered."""
    calls: list[Call] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds
    counter = iter(range(start, start + 10**9))

    def client(k: int) -> None:
        stub = pb_grpc.EncoderServiceStub(channels[k % len(channels)])
        while time.monotonic() < stop_at:
            with lock:
                i = next(counter)
            req, check = request(i)
            t = time.monotonic()
            code, response = code_of(lambda: stub.Encode(req, timeout=WAIT))  # noqa: B023 (called at once)
            call = Call(t, time.monotonic(), code, code == OK and check(response))
            with lock:
                calls.append(call)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 2 * WAIT)
    return calls


def open_loop(
    channels: Sequence[grpc.Channel], request: Requests, *, rate: float, seconds: float, start: int = 0
) -> tuple[list[Call], int]:
    """Send at `rate` requests/s for `seconds` whatever the answers (asynchronously), then wait for every
    answer. Returns the calls answered and the number sent; a sender that falls behind does not catch
    up by more than 50 ms of requests (so the rate reported is what was really offered)."""
    calls: list[Call] = []
    lock = threading.Lock()
    pending: list[grpc.Future] = []
    stubs = [pb_grpc.EncoderServiceStub(ch) for ch in channels]
    t0 = time.monotonic()
    next_send, sent = t0, 0
    while (now := time.monotonic()) < t0 + seconds:
        if now < next_send:
            time.sleep(next_send - now)
            continue
        next_send = max(next_send + 1 / rate, now - 0.05)
        req, check = request(start + sent)
        t = time.monotonic()
        future = stubs[sent % len(stubs)].Encode.future(req, timeout=WAIT)

        def done(f: grpc.Future, t: float = t, check: Callable[[pb.EncodeResponse], bool] = check) -> None:
            end = time.monotonic()
            code = f.code().name
            call = Call(t, end, code, code == OK and check(f.result()))
            with lock:
                calls.append(call)

        future.add_done_callback(done)
        pending.append(future)
        sent += 1
    deadline = time.monotonic() + 2 * WAIT
    for f in pending:
        with contextlib.suppress(grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError):
            f.result(timeout=max(0.0, deadline - time.monotonic()))
    wait_until(lambda: len(calls) >= sum(f.done() for f in pending), "the callbacks of finished calls", 5)
    return list(calls), sent


def windows(calls: Sequence[Call], start: float, end: float, width: float = 0.5) -> list[float]:
    """Inputs answered OK per second, in windows of `width` seconds from `start` to `end`."""
    n = max(1, int((end - start) / width))
    counts = [0] * n
    for c in calls:
        if c.code == OK and start <= c.done < start + n * width:
            counts[int((c.done - start) / width)] += 1
    return [k / width for k in counts]


def scripted_requests(tokens: int = 8, vocab: int = 256) -> Requests:
    """One input of `tokens` ids per request, unique per i, checked against ScriptedEngine's answer."""

    def request(i: int) -> tuple[pb.EncodeRequest, Callable[[pb.EncodeResponse], bool]]:
        a, b = 20 + i % (vocab - 20), 20 + (i // (vocab - 20)) % (vocab - 20)
        ids = [a, b] + [5] * (tokens - 2)
        want = expected_row(ids)

        def check(r: pb.EncodeResponse) -> bool:
            return len(r.embeddings) == 1 and list(r.embeddings[0].values) == want

        return pb.EncodeRequest(token_ids=[pb.TokenIds(ids=ids)], normalize=False), check

    return request


def text_requests(address: str, texts: Sequence[str]) -> Requests:
    """One text per request (truncated to the model's length), cycling over `texts`, checked against each
    text's embedding asked for alone."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        reference = [
            np.array(stub.Encode(pb.EncodeRequest(texts=[t], truncate=True), timeout=WAIT).embeddings[0].values)
            for t in texts
        ]

    def request(i: int) -> tuple[pb.EncodeRequest, Callable[[pb.EncodeResponse], bool]]:
        k = i % len(texts)

        def check(r: pb.EncodeResponse) -> bool:
            return (
                len(r.embeddings) == 1 and float(np.abs(np.array(r.embeddings[0].values) - reference[k]).max()) < 1e-4
            )

        return pb.EncodeRequest(texts=[texts[k]], truncate=True), check

    return request


WORDS = ("the", "model", "serves", "embeddings", "of", "sentences", "for", "search", "and", "ranking", "texts")


def queue_texts(n: int, seed: int = 0) -> list[str]:
    """Sentences of varied length for the load scenarios."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))) for _ in range(n)]
