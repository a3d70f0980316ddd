"""The dynamic batcher: inputs from many requests coalesced into padded batches under a token budget.

Requests are split into their sequences (one per input); a batch is a set of sequences, so one large
request can share a batch with others and spread over several. The "length" policy anchors each batch
on the oldest waiting sequence (nothing starves) and grows it with the sequences nearest in length
while its padding stays under a cap (`max_padding`); "arrival" takes sequences strictly in order (the
baseline to compare against).

What Infinity's batch worker got wrong, and what this one does instead:
- a failed batch fails the futures of exactly the requests that had a sequence in it, then the worker
  goes on with the next batch;
- waiting is event-driven: an `asyncio.Event` set on arrival, and one timed wait for `max_wait_ms`;
- a request whose client cancelled, or whose deadline passed, frees its queue slots at once and its
  sequences are skipped before inference;
- a request takes its queue slots before it is tokenised (`admit`), so past the limit it is refused at
  once, before any costly work, and inputs waiting to be tokenised count against the limit too;
- inference runs on one worker thread (ONNX Runtime releases the GIL), never on the event loop;
- a watchdog bounds each batch (`inference_timeout`): a batch past it fails its requests with
  UNAVAILABLE, the queue is failed and new work refused, and `on_stall` tells the server (which reports
  NOT_SERVING); if the engine ever returns, `on_recover` does, and batches run again.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from operator import attrgetter
from typing import Protocol

import numpy as np
import numpy.typing as npt

from service.engine import Engine
from service.errors import DeadlineExceeded, Internal, ResourceExhausted, ServiceError, Unavailable
from service.metrics import Metrics
from service.settings import Batching, Limits

log = logging.getLogger(__name__)

Ids = npt.NDArray[np.int64]
Embeddings = npt.NDArray[np.float32]


class _Job:
    """One request's sequences: resolved when all of them are embedded, or failed as a whole."""

    __slots__ = (
        "future",
        "n",
        "remaining",
        "queued",
        "queued_tokens",
        "out",
        "deadline",
        "request_id",
        "enqueued",
        "started",
    )

    def __init__(self, future: asyncio.Future[Embeddings], n: int, deadline: float | None, request_id: str) -> None:
        self.future = future
        self.n = self.remaining = self.queued = n
        self.queued_tokens = 0
        self.out: Embeddings | None = None
        self.deadline = deadline  # on the event loop's clock
        self.request_id = request_id
        self.enqueued = time.perf_counter()
        self.started = False


class _Seq:
    __slots__ = ("job", "index", "ids", "length", "key", "taken")

    def __init__(self, job: _Job, index: int, ids: Ids, order: int) -> None:
        self.job = job
        self.index = index
        self.ids = ids
        self.length = int(ids.shape[0])
        self.key = (self.length, order)  # order breaks ties, so keys are unique
        self.taken = False


Live = Callable[[_Seq], bool]


class Ticket:
    """Queue slots held for one request between admission and queueing (while it is tokenised)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n


Hook = Callable[[], Awaitable[None]]


class _Policy(Protocol):
    def push(self, seqs: Sequence[_Seq]) -> None: ...

    def oldest(self, live: Live) -> _Seq | None: ...

    def take(self, budget: int, live: Live) -> list[_Seq]: ...

    def clear(self) -> None: ...


class ArrivalOrder:
    """Sequences in the order they came, while the padded batch fits the budget."""

    def __init__(self) -> None:
        self._queue: deque[_Seq] = deque()

    def push(self, seqs: Sequence[_Seq]) -> None:
        self._queue.extend(seqs)

    def oldest(self, live: Live) -> _Seq | None:
        q = self._queue
        while q and not live(q[0]):
            q.popleft()
        return q[0] if q else None

    def take(self, budget: int, live: Live) -> list[_Seq]:
        q, batch, longest = self._queue, list[_Seq](), 0
        while q:
            s = q[0]
            if not live(s):
                q.popleft()
                continue
            wider = max(longest, s.length)
            if batch and (len(batch) + 1) * wider > budget:
                break
            batch.append(q.popleft())
            longest = wider
        return batch

    def clear(self) -> None:
        self._queue.clear()


_key = attrgetter("key")


class LengthAware:
    """The oldest waiting sequence, plus the waiting sequences nearest to it in length.

    A list kept sorted by length holds every waiting sequence; the batch is a contiguous window of it
    around the anchor, grown one sequence at a time on the side that adds the least padding, while the
    batch fits the token budget and its padding stays within `max_padding` (a fraction of its tokens).
    The budget alone is not enough: when it is larger than the queue, every waiting sequence fits, and
    a batch of ten-token queries is padded to the one 256-token paragraph among them.
    """

    def __init__(self, max_padding: float = 1.0) -> None:
        self.max_padding = max_padding
        self._arrivals: deque[_Seq] = deque()  # oldest first; taken or dead ones are dropped lazily
        self._sorted: list[_Seq] = []

    def push(self, seqs: Sequence[_Seq]) -> None:
        self._arrivals.extend(seqs)
        for s in seqs:
            bisect.insort(self._sorted, s, key=_key)

    def oldest(self, live: Live) -> _Seq | None:
        q = self._arrivals
        while q and not live(q[0]):
            q.popleft()
        return q[0] if q else None

    def _fits(self, rows: int, width: int, real: int, budget: int) -> bool:
        """Would a batch of `rows` sequences, padded to `width`, holding `real` tokens, be allowed?"""
        padded = rows * width
        return padded <= budget and padded - real <= self.max_padding * padded

    def take(self, budget: int, live: Live) -> list[_Seq]:
        anchor = self.oldest(live)
        if anchor is None:
            self._sorted.clear()  # only dead entries can be left
            return []
        self._arrivals.popleft()
        srt = self._sorted
        i = bisect.bisect_left(srt, anchor.key, key=_key)
        batch, longest, real = [anchor], anchor.length, anchor.length
        left, right = i - 1, i + 1
        while True:
            while left >= 0 and not live(srt[left]):
                left -= 1
            while right < len(srt) and not live(srt[right]):
                right += 1
            rows = len(batch) + 1
            # Sorted by length: a left neighbour never widens the batch, a right one may.
            fit_left = left >= 0 and self._fits(rows, longest, real + srt[left].length, budget)
            fit_right = right < len(srt) and self._fits(rows, srt[right].length, real + srt[right].length, budget)
            if not (fit_left or fit_right):
                break
            if fit_left and (not fit_right or longest - srt[left].length <= (srt[right].length - longest) * len(batch)):
                batch.append(srt[left])
                real += srt[left].length
                left -= 1
            else:
                batch.append(srt[right])
                longest = srt[right].length
                real += longest
                right += 1
        for s in batch:
            s.taken = True
        del srt[left + 1 : right]  # the window: the batch, and dead entries inside it
        return batch

    def clear(self) -> None:
        self._arrivals.clear()
        self._sorted.clear()


def _policy(batching: Batching, limits: Limits) -> _Policy:
    return LengthAware(limits.max_padding) if batching == "length" else ArrivalOrder()


def pad(seqs: Sequence[Ids], pad_id: int) -> tuple[Ids, Ids]:
    """(B, T) ids and mask for sequences of different lengths, T the longest."""
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = s
        mask[row, : len(s)] = 1
    return ids, mask


class Batcher:
    """Queues sequences, forms batches, runs them on the engine one at a time, resolves the requests."""

    def __init__(
        self,
        engine: Engine,
        *,
        limits: Limits,
        batching: Batching = "length",
        pad_id: int = 0,
        metrics: Metrics | None = None,
        inference_timeout: float | None = None,
        on_stall: Hook | None = None,
        on_recover: Hook | None = None,
    ) -> None:
        self.engine = engine
        self.limits = limits
        self.batching = batching
        self.pad_id = pad_id
        self.metrics = metrics or Metrics()
        self._policy = _policy(batching, limits)
        self._depth = 0  # live sequences waiting
        self._reserved = 0  # slots admitted requests hold while they are tokenised
        self._tokens = 0  # their tokens, unpadded
        self._order = 0
        self._arrived = asyncio.Event()
        self._draining = False
        self._closed = False
        self._worker: asyncio.Task[None] | None = None
        self.inference_timeout = inference_timeout or None  # 0: no watchdog
        self.on_stall = on_stall
        self.on_recover = on_recover
        self.stalled = False  # a batch overran inference_timeout and its engine call has not returned
        # One thread: concurrent ORT runs on one session only fight over the same cores.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")

    @property
    def depth(self) -> int:
        """Inputs waiting for the model: queued, or admitted and being tokenised."""
        return self._depth + self._reserved

    def admit(self, n: int) -> Ticket:
        """Hold `n` queue slots for a request about to be tokenised; ResourceExhausted at once if they would
        pass the limit. `submit(ticket=)` turns them into queued inputs; `release` gives back the rest."""
        self._refuse(n)
        self._reserved += n
        self.metrics.queue_depth.set(self.depth)
        return Ticket(n)

    def release(self, ticket: Ticket) -> None:
        """Give back what a ticket still holds (its request failed or was cancelled before queueing)."""
        if ticket.n:
            self._reserved -= ticket.n
            ticket.n = 0
            self.metrics.queue_depth.set(self.depth)

    def _refuse(self, n: int) -> None:
        if self._closed:
            raise Unavailable("the server is shutting down")
        if self.stalled:
            raise Unavailable(self._stalled_message())
        if self.depth + n > self.limits.max_queue_size:
            raise ResourceExhausted(
                f"the queue is full ({self.depth} inputs waiting, limit {self.limits.max_queue_size}); retry later"
            )

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    def drain(self) -> None:
        """Stop waiting for batches to fill: everything queued goes to the model at once."""
        self._draining = True
        self._arrived.set()

    async def close(self) -> None:
        """Refuse new work, fail what is still queued, stop the worker."""
        self._closed = True
        self.drain()
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None
        self._fail_queued(Unavailable("the server stopped before this request reached the model"))
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(
        self,
        seqs: Sequence[Ids],
        *,
        deadline: float | None = None,
        request_id: str = "",
        ticket: Ticket | None = None,
    ) -> Embeddings:
        """Embed one request's sequences: (len(seqs), d) float32, in order.

        Raises ResourceExhausted at once when the queue is full (unless `ticket` holds the slots already),
        Unavailable once closed, and the batch's error when the batch holding one of these sequences fails.
        """
        n = len(seqs)
        if ticket is not None:
            self.release(ticket)  # its slots become the queued inputs below
            if self._closed or self.stalled:
                self._refuse(0)
        else:
            self._refuse(n)
        loop = asyncio.get_running_loop()
        job = _Job(loop.create_future(), n, deadline, request_id)
        items = []
        for i, ids in enumerate(seqs):
            self._order += 1
            items.append(_Seq(job, i, ids, self._order))
            job.queued_tokens += items[-1].length
        self._policy.push(items)
        self._depth += n
        self._tokens += job.queued_tokens
        self.metrics.queue_depth.set(self.depth)
        self._arrived.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            # The client went away (or the RPC's deadline passed): give its slots back now.
            self._release(job)
            raise

    # ---- the worker -------------------------------------------------------------------------------

    def _release(self, job: _Job) -> None:
        self._depth -= job.queued
        self._tokens -= job.queued_tokens
        job.queued = job.queued_tokens = 0
        self.metrics.queue_depth.set(self.depth)

    def _fail(self, job: _Job, error: BaseException) -> None:
        if not job.future.done():
            job.future.set_exception(error)
        self._release(job)

    def _fail_queued(self, error: ServiceError) -> None:
        while (s := self._policy.oldest(self._live)) is not None:
            self._fail(s.job, error)
        self._policy.clear()

    def _live(self, s: _Seq) -> bool:
        job = s.job
        if s.taken or job.future.done():
            return False
        if job.deadline is not None and job.deadline <= asyncio.get_running_loop().time():
            self._fail(job, DeadlineExceeded("the deadline passed while the request was queued"))
            return False
        return True

    async def _wait_for_batch(self) -> None:
        """Return when a batch should start: the budget is full, the oldest input waited long enough, or we drain."""
        while True:
            self._arrived.clear()
            oldest = self._policy.oldest(self._live)
            if oldest is None:
                # Only cancelled or expired entries can be left: drop them now, not when the next batch's
                # window happens to pass over them (an idle server would hold them, and their ids, forever).
                self._policy.clear()
                await self._arrived.wait()
                continue
            if self._draining or self._tokens >= self.limits.max_batch_tokens:
                return
            due = oldest.job.enqueued + self.limits.max_wait_ms / 1000 - time.perf_counter()
            if due <= 0:
                return
            # Wake on a new arrival (the budget may now be full) or when the oldest has waited enough.
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=due)
            except TimeoutError:
                return

    async def _run(self) -> None:
        while True:
            await self._wait_for_batch()
            batch = self._policy.take(self.limits.max_batch_tokens, self._live)
            # A deadline found passed while the window grew may have failed a job with a sequence already in it.
            batch = [s for s in batch if not s.job.future.done()]
            if batch:
                await self._execute(batch)
            del batch  # while idle, keep nothing of the last batch's requests alive

    async def _execute(self, batch: list[_Seq]) -> None:
        now = time.perf_counter()
        jobs: dict[int, _Job] = {}
        for s in batch:
            job = s.job
            job.queued -= 1
            job.queued_tokens -= s.length
            self._tokens -= s.length
            jobs[id(job)] = job
            if not job.started:
                job.started = True
                self.metrics.queue_wait.observe(now - job.enqueued)
        self._depth -= len(batch)
        self.metrics.queue_depth.set(self.depth)
        run = asyncio.wrap_future(self._executor.submit(self._infer, batch))
        try:
            if self.inference_timeout is not None:
                done, _ = await asyncio.wait((run,), timeout=self.inference_timeout)
                if not done:
                    await self._stall(run, list(jobs.values()), len(batch))
                    return
            embeddings = await run
            self._resolve(batch, embeddings)
        except asyncio.CancelledError:
            run.cancel()
            for job in jobs.values():
                self._fail(job, Unavailable("the server stopped while this request was computing"))
            raise
        except ServiceError as e:
            for job in jobs.values():
                self._fail(job, e)
        except Exception as e:
            ids = ", ".join(sorted({j.request_id for j in jobs.values() if j.request_id}))
            log.exception("inference failed on a batch of %d inputs (requests: %s)", len(batch), ids or "-")
            error = Internal(f"inference failed on the batch holding this request ({type(e).__name__}); retry")
            for job in jobs.values():
                self._fail(job, error)

    def _stalled_message(self) -> str:
        return (
            f"the model has not answered for more than {self.inference_timeout:g} s (--inference-timeout); "
            "this server reports NOT_SERVING: retry on another replica"
        )

    async def _stall(self, run: asyncio.Future[Embeddings], jobs: list[_Job], size: int) -> None:
        """A batch overran the watchdog: fail it and the queue, tell the server, wait for the engine to return.

        A thread cannot be stopped from outside, so the batch keeps the inference thread until the
        engine returns (if ever); meanwhile nothing else can run, and nothing is accepted.
        """
        ids = ", ".join(sorted({j.request_id for j in jobs if j.request_id}))
        log.error(
            "inference on a batch of %d inputs has run for more than %g s (--inference-timeout); failing its "
            "requests (%s) and the queue, reporting NOT_SERVING until the engine returns",
            size,
            self.inference_timeout,
            ids or "-",
        )
        self.stalled = True
        run.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, so never logged as lost
        error = Unavailable(self._stalled_message())
        for job in jobs:
            self._fail(job, error)
        self._fail_queued(error)
        started = time.perf_counter()
        if self.on_stall is not None:
            await self.on_stall()
        await asyncio.wait((run,))
        self.stalled = False
        log.warning(
            "the stalled batch returned after %.1f s (%s); accepting requests again",
            time.perf_counter() - started + (self.inference_timeout or 0),
            "failed" if run.exception() is not None else "its results were discarded",
        )
        if self.on_recover is not None:
            await self.on_recover()

    def _infer(self, batch: list[_Seq]) -> Embeddings:
        """On the inference thread: pad, run, check the shape."""
        ids, mask = pad([s.ids for s in batch], self.pad_id)
        t0 = time.perf_counter()
        out = self.engine.run(ids, mask)
        self.metrics.inference.observe(time.perf_counter() - t0)
        if out.ndim != 2 or out.shape[0] != len(batch):
            raise RuntimeError(f"engine returned shape {out.shape} for a batch of {len(batch)}")
        real = int(mask.sum())
        self.metrics.batch_size.observe(len(batch))
        self.metrics.batch_tokens.observe(ids.size)
        self.metrics.padding_fraction.observe(1.0 - real / ids.size)
        return out

    def _resolve(self, batch: list[_Seq], embeddings: Embeddings) -> None:
        done = 0
        for row, s in enumerate(batch):
            job = s.job
            if job.future.done():  # cancelled, or failed in another batch
                continue
            if job.out is None:
                job.out = np.empty((job.n, embeddings.shape[1]), dtype=np.float32)
            job.out[s.index] = embeddings[row]
            job.remaining -= 1
            done += 1
            if job.remaining == 0:
                job.future.set_result(job.out)
        self.metrics.inputs.inc(done)
