"""The reliability scenarios, each one function whose arguments set its size.

Every scenario returns its figures (requests sent, status codes received, counts before and after)
and asserts nothing itself: `tests/reliability/` asserts on the short runs, `python -m
loadtest.reliability` reports the long ones. None asserts on time; times are reported.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mhaserve.loadtest.reliability.strategies import Model, encode_requests, infer_requests, names, request_ids
from mhaserve.loadtest.stats import percentile, slope
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.proto.inference.v2 import grpc_service_pb2 as kpb
from mhaserve.proto.inference.v2 import grpc_service_pb2_grpc as kpb_grpc
from mhaserve.service.client import CHANNEL_OPTIONS
from mhaserve.service.kserve.tensors import pack_bytes
from mhaserve.testing.engines import ScriptedEngine, expected_row
from mhaserve.testing.loopback import WAIT, wait_until
from mhaserve.testing.metrics import scrape
from mhaserve.testing.process import Sample, ServerProcess, live_objects, sample
from mhaserve.testing.server import ServerThread, health_status

OK = grpc.StatusCode.OK.name
CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}
# What bad input may get: never INTERNAL or UNKNOWN (a bug), never UNAVAILABLE (the server gave up).
CLIENT_CODES = frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED"})


def code_of(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return OK, call()
    except grpc.RpcError as e:
        return e.code().name, None
    except grpc.FutureCancelledError:  # a future the client cancelled itself
        return grpc.StatusCode.CANCELLED.name, None


@dataclass(frozen=True)
class Latencies:
    """p50, p99 and max of some latencies, in seconds (NaN when there were none)."""

    count: int
    p50: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Latencies:
        return cls(len(values), percentile(values, 50), percentile(values, 99), max(values, default=float("nan")))


# ---- bad input --------------------------------------------------------------------------------------


@dataclass
class FuzzResult:
    """Cases tried per API, the status codes they got (stream errors included), and what went wrong."""

    cases: Counter[str] = field(default_factory=Counter)
    codes: dict[str, Counter[str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    checks_after: int = 0  # health + good request checks, one after every case
    seconds: float = 0.0


GOOD_TEXTS = ["a good request right after", "and a second input"]


def fuzz(address: str, model: Model, *, examples: int, seed: int | None = 0) -> FuzzResult:
    """Hypothesis over every request field of encoder.v1 and the Open Inference Protocol, `examples` cases
    per API, against a running server. After every case: health must say SERVING and a good request must
    get the same embeddings as before the fuzzing."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as with_seed
    from hypothesis import strategies as st

    result = FuzzResult(codes={"encoder.v1": Counter(), "inference.v2": Counter()})
    t0 = time.perf_counter()
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    enc = pb_grpc.EncoderServiceStub(channel)
    inf = kpb_grpc.GRPCInferenceServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    good = pb.EncodeRequest(texts=GOOD_TEXTS)
    tensor = kpb.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[len(GOOD_TEXTS)])
    good_v2 = kpb.ModelInferRequest(
        model_name=model.name, inputs=[tensor], raw_input_contents=[pack_bytes([t.encode() for t in GOOD_TEXTS])]
    )
    reference = np.array([e.values for e in enc.Encode(good, timeout=WAIT).embeddings], dtype=np.float32)

    def after(api: str) -> None:
        result.cases[api] += 1
        result.checks_after += 1
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=WAIT).status
        assert status == health_pb2.HealthCheckResponse.SERVING, f"health says {status} after that request"
        got = np.array([e.values for e in enc.Encode(good, timeout=WAIT).embeddings], dtype=np.float32)
        assert np.abs(got - reference).max() <= 1e-5, "a good request got another answer after that request"
        response = inf.ModelInfer(good_v2, timeout=WAIT)
        v2 = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(reference.shape)
        assert np.abs(v2 - reference).max() <= 1e-5

    def record(api: str, code: str, what: str) -> None:
        result.codes[api][code] += 1
        assert code in CLIENT_CODES, f"{what} got {code}"

    def metadata(rid: str) -> tuple[tuple[str, str], ...] | None:
        return (("x-request-id", rid),) if rid else None

    config = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )

    @config
    @given(data=st.data())
    def encoder_v1(data: st.DataObject) -> None:
        method = data.draw(st.sampled_from(["Encode", "Encode", "Encode", "EncodeStream", "GetModelInfo"]))
        md = metadata(data.draw(request_ids()))
        if method == "Encode":
            request = data.draw(encode_requests(model))
            code, _ = code_of(lambda: enc.Encode(request, metadata=md, timeout=60))
            record("encoder.v1", code, "Encode")
        elif method == "EncodeStream":
            requests = data.draw(st.lists(encode_requests(model), max_size=4))
            code, responses = code_of(lambda: list(enc.EncodeStream(iter(requests), metadata=md, timeout=60)))
            record("encoder.v1", code, "EncodeStream")
            for r in responses or ():
                record("encoder.v1", CODE_NAMES[r.error.code] if r.HasField("error") else OK, "a stream response")
            assert responses is None or len(responses) == len(requests), "a stream lost a response"
        else:
            name = data.draw(names(model))
            code, _ = code_of(lambda: enc.GetModelInfo(pb.GetModelInfoRequest(model=name), metadata=md, timeout=60))
            record("encoder.v1", code, "GetModelInfo")
        after("encoder.v1")

    @config
    @given(data=st.data())
    def inference_v2(data: st.DataObject) -> None:
        methods = ["ModelInfer"] * 4 + ["ModelStreamInfer", "ModelMetadata", "ModelConfig", "ModelStatistics"]
        method = data.draw(st.sampled_from([*methods, "ModelReady", "ServerMetadata", "ServerReady"]))
        md = metadata(data.draw(request_ids()))
        if method == "ModelInfer":
            request = data.draw(infer_requests(model))
            code, _ = code_of(lambda: inf.ModelInfer(request, metadata=md, timeout=60))
        elif method == "ModelStreamInfer":
            requests = data.draw(st.lists(infer_requests(model), max_size=4))
            code, responses = code_of(lambda: list(inf.ModelStreamInfer(iter(requests), metadata=md, timeout=60)))
            for r in responses or ():
                record("inference.v2", r.error_message.split(":")[0] if r.error_message else OK, "a stream response")
            assert responses is None or len(responses) == len(requests), "a stream lost a response"
        else:
            name, version = data.draw(names(model)), data.draw(st.one_of(st.just(""), st.text(max_size=8)))
            stub_method = getattr(inf, method)
            request_type = getattr(kpb, f"{method}Request")
            fields = request_type.DESCRIPTOR.fields_by_name
            kwargs = {k: v for k, v in (("name", name), ("version", version)) if k in fields}
            code, _ = code_of(lambda: stub_method(request_type(**kwargs), metadata=md, timeout=60))
        record("inference.v2", code, method)
        after("inference.v2")

    try:
        for test in (encoder_v1, inference_v2):
            if seed is not None:
                test = with_seed(seed)(test)
            try:
                test()
            except Exception as e:  # hypothesis has shrunk it: report the smallest case
                result.failures.append(f"{test.__name__}: {type(e).__name__}: {e}")
    finally:
        channel.close()
        result.seconds = time.perf_counter() - t0
    return result


# ---- load: closed and open loops --------------------------------------------------------------------


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


# ---- overload ---------------------------------------------------------------------------------------


@dataclass
class OverloadResult:
    """An open-loop burst at `factor` times the measured capacity, with closed-loop runs before and after."""

    max_queue_size: int
    capacity: float  # requests (of one input) answered per second, closed loop, before the burst
    factor: float
    offered_rate: float  # requests/s the burst aimed at
    sent_rate: float  # requests/s it really sent
    burst_seconds: float
    sent: int
    answered: int
    codes: Counter[str]
    wrong: int  # OK answers with the wrong embedding
    admitted: Latencies  # the burst's OK requests
    refused: Latencies  # the burst's RESOURCE_EXHAUSTED requests
    burst_throughput: float  # requests answered OK per second during the burst
    closed_loop_p99: float
    # An admitted request waits for the batch computing when it came, for the inputs queued ahead of it, and
    # for its own batch: each at most a queue's worth, so 3 * max_queue_size / burst_throughput, plus the
    # closed-loop p99 for the rest of its path.
    bound: float
    after: list[float]  # throughput per 0.5 s window after the burst ends
    recovery: float | None  # seconds from the end of the burst to the first window at >= 80% of capacity
    client_codes: Counter[str] = field(default_factory=Counter)  # every call of the scenario, burst or not
    server_codes: dict[str, int] = field(default_factory=dict)  # the server's count of the same calls

    @property
    def lost(self) -> int:
        return self.sent - self.answered


def overload(
    address: str,
    request: Requests,
    *,
    max_queue_size: int,
    factor: float = 5.0,
    burst_seconds: float = 3.0,
    measure_seconds: float = 3.0,
    clients: int = 8,
    server_codes: Callable[[], dict[str, int]] | None = None,
) -> OverloadResult:
    channels = [grpc.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(4)]
    counted_before = server_codes() if server_codes else {}
    try:
        warm = closed_loop(channels, request, clients=clients, seconds=min(1.0, measure_seconds))
        before = closed_loop(channels, request, clients=clients, seconds=measure_seconds, start=10**6)
        ok_before = [c for c in before if c.code == OK]
        capacity = len(ok_before) / measure_seconds
        p99 = percentile([c.latency for c in ok_before], 99)
        rate = factor * capacity
        burst_start = time.monotonic()
        burst_calls: list[Call] = []
        sent_box: list[int] = []

        def burst() -> None:
            calls, sent = open_loop(channels, request, rate=rate, seconds=burst_seconds, start=2 * 10**6)
            burst_calls.extend(calls)
            sent_box.append(sent)

        sender = threading.Thread(target=burst, daemon=True)
        sender.start()
        time.sleep(burst_seconds)
        burst_end = time.monotonic()
        after_calls = closed_loop(channels, request, clients=clients, seconds=measure_seconds, start=3 * 10**6)
        sender.join(3 * WAIT)
        sent = sent_box[0] if sent_box else 0
    finally:
        for ch in channels:
            ch.close()
    after = windows(after_calls, burst_end, burst_end + measure_seconds)
    recovery = next((0.5 * (i + 1) for i, v in enumerate(after) if v >= 0.8 * capacity), None)
    codes = Counter(c.code for c in burst_calls)
    client_codes = Counter(c.code for c in warm + before + burst_calls + after_calls)
    if server_codes:  # the server counts a call just after answering it: give the last ones a moment
        with contextlib.suppress(TimeoutError):
            wait_until(
                lambda: sum(server_codes().values()) - sum(counted_before.values()) >= sum(client_codes.values()),
                "the server to count every call",
                5,
            )
    admitted = [c.latency for c in burst_calls if c.code == OK]
    span = max((c.done for c in burst_calls), default=burst_end) - burst_start
    throughput = len(admitted) / max(span, 1e-9)
    return OverloadResult(
        max_queue_size=max_queue_size,
        capacity=capacity,
        factor=factor,
        offered_rate=rate,
        sent_rate=sent / max(burst_end - burst_start, 1e-9),
        burst_seconds=burst_seconds,
        sent=sent,
        answered=len(burst_calls),
        codes=codes,
        wrong=sum(1 for c in burst_calls + before + after_calls if c.code == OK and not c.correct),
        admitted=Latencies.of(admitted),
        refused=Latencies.of([c.latency for c in burst_calls if c.code == "RESOURCE_EXHAUSTED"]),
        burst_throughput=throughput,
        closed_loop_p99=p99,
        bound=3 * max_queue_size / max(throughput, 1e-9) + p99,
        after=after,
        recovery=recovery,
        client_codes=client_codes,
        server_codes={k: v - counted_before.get(k, 0) for k, v in server_codes().items()} if server_codes else {},
    )


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


# ---- deadlines and cancellation -------------------------------------------------------------------


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


EXPIRED, CANCELLED, STREAMED, HOLD = 201, 202, 203, 99


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


# ---- faults ---------------------------------------------------------------------------------------


POISON = 13


@dataclass
class FaultResult:
    requests: int = 0
    poisoned: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    poisoned_codes: Counter[str] = field(default_factory=Counter)
    failed_without_poison_in_batch: int = 0  # a request failed though no batch it was in held poison
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
    """Concurrent requests, some holding the token the engine raises on: only the batches that held one
    may fail, each with INTERNAL; every other request gets its right answer; the server stays SERVING."""
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
        batches = list(engine.batches)  # every batch has run: all answers are in
        for ids, code, response in answers:
            (result.poisoned_codes if POISON in ids else result.codes)[code] += 1
            if code == OK:
                result.wrong += list(response.embeddings[0].values) != expected_row(ids)
            elif POISON not in ids:
                row = list(ids)
                if not any(row in batch and any(POISON in r for r in batch) for batch in batches):
                    result.failed_without_poison_in_batch += 1
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
            result.refused_codes[code_of(lambda: stub.Encode(pb.EncodeRequest(texts=["x"]), timeout=WAIT))[0]] += 1  # noqa: B023
            engine.release.set()
            wait_until(lambda: health_status(channel) == "SERVING", "health to report SERVING again")  # noqa: B023
            again = code_of(lambda: stub.Encode(pb.EncodeRequest(texts=["back"]), timeout=WAIT))[0]  # noqa: B023
            result.recovered += again == OK
            result.hangs += 1
    return result


# ---- a real process: soak and shutdown -----------------------------------------------------------


@dataclass
class SoakResult:
    seconds: float
    warmup: float
    clients: int
    codes: Counter[str]
    samples: list[Sample]
    bound_kib_per_min: float

    def steady(self) -> list[Sample]:
        return [s for s in self.samples if s.t >= self.warmup]

    @property
    def rss_slope_kib_per_min(self) -> float:
        steady = self.steady()
        return 60 * slope([s.t for s in steady], [float(s.rss_kib) for s in steady])

    @property
    def requests(self) -> int:
        return sum(self.codes.values())


def soak(
    proc: ServerProcess,
    request: Requests,
    *,
    seconds: float,
    clients: int = 4,
    interval: float = 1.0,
    warmup: float | None = None,
    bound_kib_per_min: float = 1024.0,
) -> SoakResult:
    """Steady closed-loop load for `seconds`, the server's resident memory, descriptors and threads sampled
    every `interval`; the memory slope is fitted after `warmup` seconds (default: the first quarter)."""
    address = proc.address()
    warmup = seconds / 4 if warmup is None else warmup
    samples: list[Sample] = []
    t0 = time.monotonic()
    done = threading.Event()

    def sampler() -> None:
        while not done.is_set():
            samples.append(sample(proc.pid, t0))
            done.wait(interval)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    channels = [grpc.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(2)]
    try:
        calls = closed_loop(channels, request, clients=clients, seconds=seconds)
    finally:
        done.set()
        thread.join(WAIT)
        for ch in channels:
            ch.close()
    samples.append(sample(proc.pid, t0))
    codes = Counter(c.code if c.code != OK or c.correct else "OK (wrong answer)" for c in calls)
    return SoakResult(seconds, warmup, clients, codes, samples, bound_kib_per_min)


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


WORDS = ("the", "model", "serves", "embeddings", "of", "sentences", "for", "search", "and", "ranking", "texts")


def queue_texts(n: int, seed: int = 0) -> list[str]:
    """Sentences of varied length for the load scenarios."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))) for _ in range(n)]
