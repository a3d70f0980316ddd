"""The ordered stream loop behind EncodeStream and ModelStreamInfer, alone: random streams of requests that
take their time, fail, or end the stream, a client that stops reading or breaks its stream, any window."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, AsyncIterator

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mhaserve.runtime.errors import Cancelled, DeadlineExceeded, Internal, InvalidArgument, ServiceError, Unavailable
from mhaserve.service.rpc.streaming import ordered

EXAMPLES = int(os.environ.get("STREAM_EXAMPLES", "200"))
FATAL = {"unavailable": Unavailable, "deadline": DeadlineExceeded, "cancelled": Cancelled}


class BrokenStream(Exception):
    """The client's stream failed to read (a malformed message, a reset)."""


# One request: how long it computes (ms), and what it ends in: an answer, an error of its own, a bug (an
# exception not a ServiceError: answered INTERNAL, the stream going on), or one that ends the stream.
_requests = st.tuples(
    st.sampled_from([0.0, 0.0, 0.1, 0.5, 2.0]),
    st.sampled_from(["ok"] * 6 + ["invalid"] * 2 + ["bug"] + list(FATAL)),
)
ERRORS = {"invalid": "INVALID_ARGUMENT", "bug": "INTERNAL", "unavailable": "UNAVAILABLE"}


@given(
    requests=st.lists(_requests, max_size=20),
    window=st.integers(1, 5),
    broken_at=st.one_of(st.none(), st.integers(0, 20)),
    read=st.one_of(st.none(), st.integers(1, 20)),
    arrivals_ms=st.sampled_from([0.0, 0.2]),
    shares=st.none() | st.lists(st.sampled_from([0.0, 0.1, 1 / 3, 0.5, 0.7, 1.0]), min_size=20, max_size=20),
    serving=st.sampled_from([None, True, False]),
)
@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_a_stream_answers_in_order_within_its_window_and_leaves_nothing_running(
    requests: list[tuple[float, str]],
    window: int,
    broken_at: int | None,
    read: int | None,
    arrivals_ms: float,
    shares: list[float] | None,
    serving: bool | None,
) -> None:
    """Responses come in request order, one a request, each an answer or its own error (a bug's INTERNAL), until
    the first request whose failure ends the stream (its error is the stream's end) or the point where the client's
    stream broke (that error ends it, after the responses of what came before it); never more than `window`
    requests compute at once, nor (with `shares`: each request's part of its model's queue) more than fill it
    but one alone; an UNAVAILABLE ends the stream unless the server still serves (`serving`: then it is its own
    request's, a model loading, and the stream goes on); and however the stream ends, even when its reader stops
    early (`read` responses, then closes), no computation is left running and each response is counted once by
    its status."""

    async def main() -> None:
        computing, most, running = 0, 0, set[int]()
        counted: list[str] = []

        async def incoming() -> AsyncIterator[int]:
            for i in range(len(requests)):
                if i == broken_at:
                    raise BrokenStream(f"broken before request {i}")
                if arrivals_ms:
                    await asyncio.sleep(arrivals_ms / 1000)
                yield i

        async def compute(i: int) -> tuple[str, int]:
            nonlocal computing, most
            computing += 1
            most = max(most, computing)
            running.add(i)
            if shares is not None and len(running) > 1:
                assert sum(shares[j] for j in running) <= 1 + 1e-9, [(j, shares[j]) for j in sorted(running)]
            try:
                delay_ms, outcome = requests[i]
                await asyncio.sleep(delay_ms / 1000)
                if outcome == "invalid":
                    raise InvalidArgument(f"request {i} is wrong")
                if outcome == "bug":
                    raise ZeroDivisionError(f"request {i} met a bug")
                if outcome in FATAL:
                    raise FATAL[outcome](f"request {i} ends the stream")
                return ("answer", i)
            finally:
                computing -= 1
                running.discard(i)

        def on_error(i: int, error: ServiceError) -> tuple[str, int]:
            if isinstance(error, Internal):  # the bug's text stays in the log; the message points there
                assert error.message == "internal error (request id -; details are in the server log)"
                return ("bug", i)
            if isinstance(error, Unavailable):
                assert serving
                return ("unavailable", i)
            assert isinstance(error, InvalidArgument)
            return ("invalid", i)

        got: list[tuple[str, int]] = []
        ended: BaseException | None = None
        share = None if shares is None else shares.__getitem__
        still = None if serving is None else lambda: serving
        stream = ordered(incoming(), compute, on_error, window=window, count=counted.append, share=share, serving=still)
        assert isinstance(stream, AsyncGenerator)  # closed early below, as grpc closes a cancelled call's
        try:
            async for response in stream:
                got.append(response)
                if len(got) == read:
                    break
        except (ServiceError, BrokenStream) as e:
            ended = e
        finally:
            await stream.aclose()

        # What should have come: every request in order until the first that ends the stream or the break.
        expected: list[tuple[str, int]] = []
        end: str | None = None
        for i, (_, outcome) in enumerate(requests):
            if i == broken_at:
                end = "broken"
                break
            if outcome in FATAL and not (outcome == "unavailable" and serving):
                end = outcome
                break
            expected.append(("answer" if outcome == "ok" else outcome, i))
        if read is not None and read <= len(expected):
            assert got == expected[:read] and ended is None
        else:
            assert got == expected
            if end == "broken":
                assert isinstance(ended, BrokenStream)
            elif end is not None:
                assert isinstance(ended, FATAL[end]) and f"request {len(expected)}" in str(ended)  # the first fatal
            else:
                assert ended is None
        assert counted == [ERRORS.get(kind, "OK") for kind, _ in got]
        assert most <= window, f"{most} requests computed at once in a window of {window}"
        for _ in range(3):
            await asyncio.sleep(0)  # the cancelled computations unwind
        assert not running, f"requests {sorted(running)} still computing after the stream ended"

    asyncio.run(asyncio.wait_for(main(), 30))
