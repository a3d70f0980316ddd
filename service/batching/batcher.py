"""The dynamic batcher: inputs from many requests coalesced into padded batches under a token budget.

Requests are split into their sequences (one per input); a batch is a set of sequences, so one large
request can share a batch with others and spread over several. The "length" policy anchors each batch
on the next sequence of the request with the fewest inputs left (the requests are answered one after
another, so a client's deadline or a drain's grace period ends fewer of them after most of their inputs
were computed, and a query does not wait behind a large request's inputs; one passed over long enough goes
first) and grows it with the sequences nearest in length while its padding stays under a cap
(`max_padding`); "arrival" takes sequences strictly in order (the baseline to compare against).

What Infinity's batch worker got wrong, and what this one does instead:
- an input the engine fails on (it raises, or answers NaN or infinity for its row) fails its own request
  only: the batch's other rows are served, run again without it where the engine raised (_compute); a batch
  fails whole only when every input in it fails alone; either way the worker goes on with the next batch;
- waiting is event-driven: an `asyncio.Event` set on arrival, and one timed wait for `max_wait_ms`,
  only while admitted requests are still being tokenised or, with several workers, while another batch
  computes and fewer inputs than this batch's share wait (should_start): a lone request never waits;
- a request whose client cancelled, or whose deadline passed, frees its queue slots at once and its
  sequences are skipped before inference;
- a request takes its queue slots before it is tokenised (`admit`), so past the limit it is refused at
  once, before any costly work, and inputs waiting to be tokenised count against the limit too;
- inference runs on worker threads (ONNX Runtime releases the GIL), never on the event loop: one by
  default, each batch with every core; `workers` > 1 runs that many batches at once (the engine gives a
  batch that overlaps another its share of the cores: OnnxEngine.run), and forms one batch more, which
  waits in the threads' queue so that a thread that finishes a batch starts the next at once, without
  waiting for the event loop to hand it one; each batch takes at most its share of the sequences in
  the batcher (max_rows), so that the batches keep even shares of the clients; a batch formed ahead of
  a large request's inputs goes back to the queue when a smaller request comes (a query beside an
  indexing job), which then goes first (_make_way); and while smaller requests come, a larger request's
  batch takes half the token budget, so that a query that finds every worker computing waits for less
  (_budget);
- a watchdog bounds each batch's computing (`inference_timeout`, watchdog.py); when a batch overruns, the
  queue fails with it, and so do the batches formed that still wait for a thread (they are taken out of
  the threads' queue: nobody would get their answers).

The policies are in policies.py, what waits in the queue in queue.py, padding in padding.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from mhaserve.runtime.engine import Engine
from mhaserve.runtime.errors import DeadlineExceeded, Internal, QueueFull, ServiceError, Unavailable
from mhaserve.service.batching.limits import Limits
from mhaserve.service.batching.padding import pad
from mhaserve.service.batching.policies import Batching, make_policy
from mhaserve.service.batching.queue import Embeddings, Ids, Job, Seq, Spent, Ticket
from mhaserve.service.batching.watchdog import Hook, Watchdog
from mhaserve.service.metrics import Metrics, ModelMetrics

log = logging.getLogger(__name__)

# With the length policy, a batch anchored by a request takes half the token budget while requests of fewer
# inputs than it have come within this many seconds (_budget): interactive queries beside an indexing job.
SMALLER_RECENT_S = 1.0


class _Sizes:
    """When requests last came, by size class: 1 input, 2-3, 4-7, 8-15, ... (the bit length of the count)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[int, float] = {}

    def saw(self, n: int, at: float) -> None:
        self._last[n.bit_length()] = at

    def smaller_since(self, n: int, since: float) -> bool:
        """Whether a request of a smaller size class than `n` inputs came at `since` or later."""
        size = n.bit_length()
        return any(at >= since for c, at in self._last.items() if c < size)


@dataclass(frozen=True, slots=True)
class Ran:
    """A batch's outcome, from the inference thread to the loop: the rows, and what the metrics record."""

    embeddings: Embeddings
    seconds: float  # in the engine
    rows: int
    cells: int  # padded tokens
    real: int
    failed: dict[int, Exception]  # rows whose input alone failed (their embeddings rows are zeros), by row
    ended: float  # when the engine ended the batch (perf_counter): its requests' Spent


class NonFiniteOutput(RuntimeError):
    """The engine's row for an input is NaN or infinite: never served as an embedding."""


class _GaveWay(Exception):
    """A batch waiting for a thread went back to the queue for a smaller request (Batcher._make_way), or for one
    of its requests, cancelled (Batcher._withdraw)."""


def _settle(run: asyncio.Future[Ran], outcome: Ran | BaseException) -> None:
    """On the loop: the batch's future gets its outcome, unless it was cancelled meanwhile."""
    if run.done():
        return
    if isinstance(outcome, BaseException):
        run.set_exception(outcome)
    else:
        run.set_result(outcome)


class Batcher:
    """Queues sequences, forms batches, runs them on the engine (one at a time per worker), resolves the requests."""

    def __init__(
        self,
        engine: Engine,
        *,
        limits: Limits,
        batching: Batching = "length",
        pad_id: int = 0,
        metrics: ModelMetrics | None = None,
        executor: ThreadPoolExecutor | None = None,
        inference_timeout: float | None = None,
        on_stall: Hook | None = None,
        on_recover: Hook | None = None,
        workers: int = 1,
        starved: Callable[[], str | None] | None = None,
    ) -> None:
        self.engine = engine
        self.limits = limits
        self.batching = batching
        self.pad_id = pad_id
        self.metrics = metrics or ModelMetrics(Metrics(), "-", 0)
        self._policy = make_policy(batching, limits.max_padding)
        self._sizes = _Sizes()  # when requests of each size last came (_budget)
        self._depth = 0  # live sequences waiting
        self._reserved = 0  # slots admitted requests hold while they are tokenised
        self._tokens = 0  # their tokens, unpadded
        self._order = 0
        self._arrived = asyncio.Event()
        self._draining = False
        self._closed: str | None = None  # once closed: what a request that comes after is told (close)
        # While every thread it shares with other batchers holds a stalled batch: what a request is told (the
        # server's, read at each request: a batcher made while they stall, a version warming up, reads it too).
        self._starved = starved or (lambda: None)
        # With several workers, one batch more than there are threads: formed while the others compute, it
        # waits in the executor's queue, and the first thread to finish starts it. Handed over by the event
        # loop instead, a thread waited 3.3-3.5 ms at the median between its batches at 32 clients, the loop
        # busy with the requests (docs/benchmarks.md: 1.03x the short texts a second over gRPC). Not with
        # one worker: there a batch gets every core, whose speed depends on the batch's size, and one formed
        # early would split the waiting clients in two.
        self._n_batches = workers + 1 if workers > 1 else workers
        self._workers: list[asyncio.Task[None]] = []
        self._computing = 0  # sequences in the batches being computed
        # Held by a thread while it begins a batch (_begin): two may begin batches of one request at once.
        self._beginning = threading.Lock()
        # Each batch's outcome: its thread's task, and the batch.
        self._submitted: dict[asyncio.Future[Ran], tuple[Future[None], list[Seq]]] = {}
        self.watchdog = Watchdog(inference_timeout, on_stall, on_recover)
        # As many threads as workers, and the engine's intra-op threads sized to match (the server does both):
        # more concurrent runs than that only fight over the same cores. Several models share the server's
        # inference threads (`executor`) for the same reason: their batches take turns, instead of several
        # sessions' thread pools oversubscribing the machine.
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=workers, thread_name_prefix="inference")

    @property
    def stalled(self) -> bool:
        """A batch overran the inference timeout and its engine call has not returned."""
        return self.watchdog.stalled

    @property
    def depth(self) -> int:
        """Inputs in the queue, what --max-queue-size bounds: queued, or admitted and being tokenised.

        The mhaserve_queue_depth gauge, the inputs waiting for the model, also counts those in the batches
        formed that no thread has begun yet. It moves by steps (`_waiting`), never set from this count: a
        thread takes a batch's inputs off it when it begins the batch (_begin), without waking the loop."""
        return self._depth + self._reserved

    def _waiting(self, n: int) -> None:
        """`n` more inputs wait for the model (fewer when negative): the gauge's step, on the loop."""
        if n:
            self.metrics.queue_depth.inc(n)

    def admit(self, n: int) -> Ticket:
        """Hold `n` queue slots for a request about to be tokenised; ResourceExhausted at once if they would
        pass the limit. `submit(ticket=)` turns them into queued inputs; `release` gives back the rest."""
        self._refuse(n)
        self._reserved += n
        self._waiting(n)
        return Ticket(n)

    def release(self, ticket: Ticket) -> None:
        """Give back what a ticket still holds (its request failed or was cancelled before queueing)."""
        if ticket.n:
            self._reserved -= ticket.n
            self._waiting(-ticket.n)
            ticket.n = 0
            self._arrived.set()  # one fewer on its way: what waits may start now

    def _refuse(self, n: int) -> None:
        if self._closed is not None:
            raise Unavailable(self._closed)
        if self.watchdog.stalled:
            raise Unavailable(self.watchdog.message())
        if (starved := self._starved()) is not None:
            # What waited was failed (fail_waiting); what comes would wait for the stalled threads too: a
            # request that passed the server's gate before the stall, a stream's next message, a body still
            # arriving, any request in --drain-delay (whose state the stall leaves).
            raise Unavailable(starved)
        if self.depth + n > self.limits.max_queue_size:
            # "Full" only when it is: a request of several inputs may not fit in a queue that has room.
            full = "the queue is full" if self.depth >= self.limits.max_queue_size else f"the queue has no room for {n}"
            raise QueueFull(f"{full} ({self.depth} inputs waiting, limit {self.limits.max_queue_size}); retry later")

    def start(self) -> None:
        if not self._workers:
            loop = asyncio.get_running_loop()
            # In a context of their own: a task copies its creator's, and one started by a client's load
            # request wrote that request's id on every line of the batcher's for as long as the model served.
            self._workers = [
                loop.create_task(self._run(), name=f"batcher-{i}", context=contextvars.Context())
                for i in range(self._n_batches)
            ]

    def drain(self) -> None:
        """Stop waiting for batches to fill: everything queued goes to the model at once."""
        self._draining = True
        self._arrived.set()

    async def close(self, why: str = "the server is shutting down") -> None:
        """Refuse new work (saying `why`), fail what is still queued, stop the worker."""
        self._closed = why
        self.drain()
        for worker in self._workers:
            worker.cancel()
        for worker in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        self._workers = []
        self._fail_queued(Unavailable("the server stopped before this request reached the model"))
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(
        self,
        seqs: Sequence[Ids],
        *,
        deadline: float | None = None,
        request_id: str = "",
        ticket: Ticket | None = None,
        spent: Spent | None = None,
    ) -> Embeddings:
        """Embed one request's sequences: (len(seqs), d) float32, in order; `spent`, when given, is filled in
        with the request's time in the queue and in the model.

        Raises ResourceExhausted at once when the queue is full (unless `ticket` holds the slots already),
        Unavailable once closed, and the batch's error when the batch holding one of these sequences fails.
        """
        n = len(seqs)
        if ticket is not None:
            self.release(ticket)  # its slots become the queued inputs below
            if self._closed is not None or self.watchdog.stalled or self._starved() is not None:
                self._refuse(0)
        else:
            self._refuse(n)
        loop = asyncio.get_running_loop()
        job = Job(loop.create_future(), n, deadline, request_id)
        self._sizes.saw(n, job.enqueued)
        items = []
        for i, ids in enumerate(seqs):
            self._order += 1
            items.append(Seq(job, i, ids, self._order))
            job.queued_tokens += items[-1].length
        self._policy.push(items)
        self._depth += n
        self._tokens += job.queued_tokens
        self._waiting(n)
        self._arrived.set()
        self._make_way(n)
        try:
            out = await job.future
        except asyncio.CancelledError:
            # The client went away (or the RPC's deadline passed): give its slots back now, and take back a
            # batch formed ahead that holds its inputs.
            self._release(job)
            self._withdraw(job)
            raise
        if spent is not None:
            spent.queue, spent.inference = job.first - job.enqueued, job.last - job.first
        return out

    # ---- the worker -------------------------------------------------------------------------------

    def _make_way(self, n: int) -> None:
        """A request of `n` inputs just queued: a batch formed ahead that holds only larger requests' inputs
        (the policy decides: LengthAware.gives_way) is taken out of the threads' queue and goes back, so that
        the next batch formed is the newcomer's and starts when a thread is free. Beside an indexing client on
        2 cores, a query otherwise waited for a batch of its inputs on top of the batches computing."""
        for run, (started, batch) in self._submitted.items():
            if run.done():  # gave way or failed already, its worker yet to wake: nothing to move
                continue
            if self._policy.gives_way(batch, n) and started.cancel():  # only while it waits for a thread
                _settle(run, _GaveWay())
                return

    def _withdraw(self, job: Job) -> None:
        """`job` cancelled: a batch formed ahead with its inputs (several workers), still waiting for a thread, is
        taken out of the threads' queue as one that gives way, and the other requests' inputs in it wait again
        (_put_back leaves the cancelled one's out). Computed, its rows went to nobody: a request cancelled never
        reaches the model (README), and the batch's budget goes to those still waiting."""
        for run, (started, batch) in self._submitted.items():
            if not run.done() and any(s.job is job for s in batch) and started.cancel():
                _settle(run, _GaveWay())

    def _put_back(self, batch: list[Seq]) -> None:
        """The live inputs of a batch that gave way wait again, as they did before it was formed."""
        live = [s for s in batch if not s.job.future.done()]
        for s in live:
            s.job.queued += 1
            s.job.queued_tokens += s.length
            self._tokens += s.length
        self._depth += len(live)
        self._policy.put_back(live)
        self._waiting(len(live))  # and the batch's inputs leave the gauge as a batch no thread began (_execute)

    def _release(self, job: Job) -> None:
        self._depth -= job.queued
        self._tokens -= job.queued_tokens
        self._waiting(-job.queued)
        job.queued = job.queued_tokens = 0

    def _fail(self, job: Job, error: BaseException) -> None:
        if not job.future.done():
            job.future.set_exception(error)
        self._release(job)

    def _fail_queued(self, error: ServiceError) -> list[Job]:
        failed = []
        while (s := self._policy.first(self._live)) is not None:
            self._fail(s.job, error)
            failed.append(s.job)
        self._policy.clear()
        return failed

    def _live(self, s: Seq) -> bool:
        job = s.job
        if s.taken or job.future.done():
            return False
        if job.deadline is not None and job.deadline <= asyncio.get_running_loop().time():
            self._fail(job, DeadlineExceeded("the deadline passed while the request was queued"))
            return False
        return True

    def should_start(self) -> bool:
        """Whether what waits should go to the model now rather than wait for more to join it.

        At once when the budget is full or when draining. Otherwise the batch's first input waits, at most
        max_wait_ms:
        - while admitted requests are still being tokenised, since they would join it;
        - with several workers, while another batch computes (or waits for a thread) and the queue holds
          less than this batch's share (max_rows). The requests of a batch just answered come back over a
          millisecond or two; a free worker that took the first of them alone would leave the rest to a
          batch of their own, and more, smaller batches serve fewer texts a second (waiting: 1.03-1.07x
          the short texts at 32 gRPC clients, docs/benchmarks.md). A batch that ends wakes the wait (`_run`).
        A lone request never waits: nothing is on its way and nothing else computes (at one client, no one
        ever comes). Batches still form under load: what arrives while every worker computes waits for the
        next free one.
        """
        if self._draining or self._tokens >= self.limits.max_batch_tokens:
            return True
        if self._reserved:
            return False
        if self._computing:
            share = self.max_rows()
            return share is None or self._depth >= share
        return True

    async def _wait_for_batch(self) -> None:
        """Return when a batch should start (should_start), or when its first input waited long enough."""
        while True:
            self._arrived.clear()
            first = self._policy.first(self._live)
            if first is None:
                # Only cancelled or expired entries can be left: drop them now, not when the next batch's
                # window happens to pass over them (an idle server would hold them, and their ids, forever).
                self._policy.clear()
                await self._arrived.wait()
                continue
            if self.should_start():
                return
            due = first.job.enqueued + self.limits.max_wait_ms / 1000 - time.perf_counter()
            if due <= 0:
                return
            # Wake on a new arrival (the budget may now be full) or when the first has waited enough. Not
            # asyncio.wait_for: on Python 3.11 it swallows a cancellation that comes in the turn its wait ends,
            # and close() sets `_arrived` (drain) and cancels the workers in one turn: the worker went on, and
            # close() waited for it for ever.
            try:
                async with asyncio.timeout(due):
                    await self._arrived.wait()
            except TimeoutError:
                return

    def max_rows(self) -> int | None:
        """The most sequences the next batch may take: with several workers, its share of every sequence in
        the batcher, waiting or computing, among the batches in flight (the workers' and the one formed
        ahead); None (the budget decides) with one.

        Without it, two workers split the clients of a closed loop unevenly and keep them so: a worker free
        when 30 of 32 requests wait takes all 30; the other computes the 2 left, and then the 2 that come
        back, over and over, at a fraction of the first's latency. Under 32 clients on 128-token inputs
        that made p50 86 ms and p99 1.3 s. Capped, the first takes 16 and the other the rest.
        """
        if self._n_batches == 1:  # one worker
            return None
        return max(1, math.ceil((self._depth + self._computing) / self._n_batches))

    def _budget(self) -> int:
        """The next batch's token budget: the limit's, or half of it (the length policy) when the request that
        anchors it is larger than one that came within SMALLER_RECENT_S.

        A query that comes while every worker computes waits for the first batch to end, and a batch of a
        bulk request's inputs at the CPU's budget (256 tokens) holds its core for about 40 ms. On 2 cores,
        beside one and two indexing clients sending 64 texts a request, this took a query's median to 0.78x
        and 0.79x, with short texts and with paragraphs of 100-150 tokens alike, and cost the indexing
        clients nothing (docs/benchmarks.md, twenty-third session). A budget of 128 for every batch would
        cost a closed loop of 128-token inputs a row a batch (0.93x in process), so it applies only while
        smaller requests come, and never to a batch a single-text request anchors."""
        budget = self.limits.max_batch_tokens
        if self.batching != "length":  # arrival order: the baseline, as it was
            return budget
        first = self._policy.first(self._live)
        if first is not None and self._sizes.smaller_since(first.job.n, time.perf_counter() - SMALLER_RECENT_S):
            return max(1, budget // 2)
        return budget

    async def _run(self) -> None:
        """One batch in flight at a time. With several workers, each takes the next batch as soon as it is free:
        what arrived while the others compute starts at once instead of waiting for them, as a smaller batch on
        fewer cores; the batch formed ahead waits for a thread in the executor's queue."""
        while True:
            await self._wait_for_batch()
            batch = self._policy.take(self._budget(), self._live, self.max_rows())
            # A deadline found passed while the window grew may have failed a job with a sequence already in it.
            batch = [s for s in batch if not s.job.future.done()]
            if batch:
                self._computing += len(batch)  # _execute moves them out of _depth before its first await
                try:
                    await self._execute(batch)
                finally:
                    self._computing -= len(batch)
                    self._arrived.set()  # a worker waiting for its share beside this batch may start now
            del batch  # while idle, keep nothing of the last batch's requests alive

    async def _execute(self, batch: list[Seq]) -> None:
        """Hand `batch` to the inference threads and see it through. Its inputs leave the queue here but still
        wait for the model (the gauge counts them) until a thread begins the batch (_begin), which may be
        later: the batch formed ahead with several workers, or a thread that other models' batches hold."""
        jobs: dict[int, Job] = {}
        for s in batch:
            job = s.job
            job.queued -= 1
            job.queued_tokens -= s.length
            self._tokens -= s.length
            jobs[id(job)] = job
        self._depth -= len(batch)
        # Another batch computes, waits for a thread, or will start within max_wait_ms from what is queued:
        # this one takes its share of the cores even if, the instant it starts, no other run is counted.
        beside = self._computing > len(batch) or self._depth > 0
        loop = asyncio.get_running_loop()
        run: asyncio.Future[Ran] = loop.create_future()
        begun: list[float] = []  # when its thread starts it (the watchdog's bound runs from there)
        started = self._executor.submit(self._infer, batch, loop, run, begun, beside)
        self._submitted[run] = started, batch
        request_ids = ", ".join(sorted({j.request_id for j in jobs.values() if j.request_id}))

        def fail_all(error: Exception) -> None:
            for job in jobs.values():
                self._fail(job, error)

        def overran(error: ServiceError) -> None:  # the watchdog fired: this batch and everything queued
            self.metrics.stalls.inc()
            fail_all(error)
            # What never ran did not time out: UNAVAILABLE over both protocols (HTTP 503, which clients and
            # balancers retry), as new requests are refused while the batch stalls, not the batch's 504.
            waiting = Unavailable(error.message)
            never_ran = {id(j): j for j in self._fail_queued(waiting) + self._fail_unstarted(waiting)}
            if never_ran:  # their ids too, as the watchdog says the batch's: what an operator looks a client up by
                ids = sorted({j.request_id for j in never_ran.values() if j.request_id})
                log.warning("the stall refused %d request(s) that had not run (UNAVAILABLE): %s", len(never_ran),
                            ", ".join(ids) or "-")  # fmt: skip

        try:
            ran = await self.watchdog.guard(
                run, begun=begun, size=len(batch), request_ids=request_ids, fail=overran, thread=started
            )
            if ran is not None:
                # Its requests were answered in the turn that settled `run` (_finish), and run first in this
                # one: the metrics come after their next steps, off their path.
                loop.call_soon(self._observe, ran)
            elif run.done() and not run.cancelled() and run.exception() is None:
                self._observe(run.result())  # a stalled batch that returned: the tail the histogram is for
        except asyncio.CancelledError:
            started.cancel()
            run.cancel()
            fail_all(Unavailable("the server stopped while this request was computing"))
            raise
        except _GaveWay:
            self._put_back(batch)
        except ServiceError as e:
            fail_all(e)
        except Exception as e:
            log.exception("inference failed on a batch of %d inputs (requests: %s)", len(batch), request_ids or "-")
            # No "retry": whether the inputs or the engine failed is not known here, and a bad input fails again
            # (OpenAI's client retried each such 500 twice).
            fail_all(Internal(f"inference failed on the batch holding this request ({type(e).__name__})"))
        finally:
            del self._submitted[run]
            # Taken out of the threads' queue before one began it (it gave way, failed, or the batcher closed):
            # no thread takes its inputs off the gauge. A thread that began it has; `started` is either by now.
            if started.cancelled():
                self._waiting(-len(batch))

    def fail_waiting(self, error: ServiceError) -> None:
        """Fail what waits here, queued or batched for a thread, and leave what computes: the server calls it
        when every inference thread, which this batcher shares with other models', holds a stalled batch (and
        `starved` then refuses what comes)."""
        self._fail_queued(error)
        self._fail_unstarted(error)

    def _fail_unstarted(self, error: ServiceError) -> list[Job]:
        """Fail the batches that wait for a thread, and take them out of the threads' queue: each one's worker
        then fails its requests (_execute), and no thread computes it for nobody. Their requests are returned."""
        failed = []
        for run, (started, batch) in list(self._submitted.items()):
            if not started.cancel():  # only while it waits: a running one cannot be, and fails on its own
                continue
            failed += [s.job for s in batch]
            if run.done():
                # It gave way in this turn of the loop (_make_way): its worker, waking after, would put its inputs
                # back to wait for the stalled threads. Failed here, they are not put back (_put_back).
                for s in batch:
                    self._fail(s.job, error)
            else:
                _settle(run, error)
        return failed

    def _infer(
        self,
        batch: list[Seq],
        loop: asyncio.AbstractEventLoop,
        run: asyncio.Future[Ran],
        begun: list[float],
        beside: bool,
    ) -> None:
        """On the inference thread: note when it starts (`begun`, read by the watchdog), pad, run, check the
        shape, and hand the outcome to the loop.

        The handing back is the last thing this thread does: the event loop, woken by it, then finds the GIL
        free instead of waiting for this thread to let go of it (a second wake-up, ~0.1 ms on a busy VM).
        So the batch's metrics are observed on the loop (`_observe`), after the requests are answered.
        """
        begun.append(time.monotonic())
        try:
            self._begin(batch)
            outcome: Ran | BaseException = self._compute(batch, beside)
        except Exception as e:  # whatever the engine raises reaches the batch's future, as it must
            outcome = e
        except BaseException as e:  # SystemExit or KeyboardInterrupt from an engine: set on the loop's future,
            # asyncio would raise it out of the event loop and stop the server without a drain.
            outcome = RuntimeError(f"the engine raised {type(e).__name__}: {e}")
        with contextlib.suppress(RuntimeError):  # the loop closed while this batch ran: nobody is waiting
            loop.call_soon_threadsafe(self._finish, batch, run, outcome)

    def _begin(self, batch: list[Seq]) -> None:
        """On the inference thread, as it begins `batch`: its inputs no longer wait for the model (the gauge),
        and each request whose first input it holds leaves the queue now. That request's queue time, from its
        queueing to now, is taken here alone (Job.first): the histogram observes it, and Spent tells it to
        the request once answered (x-queue-time, ModelStatistics' queue). Taken when the batch was formed, it missed the
        wait of a batch formed ahead for a thread, and the second wait of one that gave way. Under a lock,
        the time read inside it: two threads may begin batches of one request at once, and the first wins."""
        with self._beginning:
            now = time.perf_counter()
            for s in batch:
                job = s.job
                if not job.first:
                    job.first = now
                    self.metrics.queue_wait.observe(now - job.enqueued)
        self.metrics.queue_depth.dec(len(batch))

    def _run_once(self, batch: Sequence[Seq], beside: bool) -> tuple[Embeddings, float, int, int]:
        """Pad and run `batch`: its rows, the engine's seconds, padded and real tokens. `beside`: see Engine.run."""
        ids, mask = pad([s.ids for s in batch], self.pad_id)
        t0 = time.perf_counter()
        out = self.engine.run(ids, mask, beside=beside)
        seconds = time.perf_counter() - t0
        if out.ndim != 2 or out.shape[0] != len(batch):
            raise RuntimeError(f"engine returned shape {out.shape} for a batch of {len(batch)}")
        return out, seconds, ids.size, int(mask.sum())

    def _compute(self, batch: list[Seq], beside: bool) -> Ran:
        """Run the batch; an input that fails alone fails its own request, not the others in its batch.

        An encoder computes each row of a batch on its own (attention stays inside a row, padding is masked), so
        a row that comes out NaN or infinite (an fp16 overflow on one text) is that input's failure only, and
        the batch's other rows are served. A run that raises is split in two and each half run again, down to
        the inputs that fail (one bad input costs about 2 log2(rows) runs more; _isolate). Raises when no row
        succeeds, and the batch then fails whole, as an engine error did before."""
        try:
            out, seconds, cells, real = self._run_once(batch, beside)
            failed: dict[int, Exception] = {}
        except Exception as e:
            if len(batch) == 1:
                raise
            out, seconds, cells, real, failed = self._isolate(batch, e, beside)
        if not np.isfinite(out).all():  # an fp16 overflow, a broken graph: no NaN is served as an embedding
            bad = np.logical_not(np.isfinite(out).all(axis=1, keepdims=True))  # (rows, 1)
            for row in np.flatnonzero(bad):
                failed.setdefault(int(row), NonFiniteOutput(f"engine returned NaN or infinite values for row {row}"))
            out = np.where(bad, np.float32(0.0), out)
        if len(failed) == len(batch):
            raise next(iter(failed.values()))
        return Ran(out, seconds, len(batch), cells, real, failed, time.perf_counter())

    def _isolate(
        self, batch: list[Seq], error: Exception, beside: bool
    ) -> tuple[Embeddings, float, int, int, dict[int, Exception]]:
        """`_compute` after the whole batch raised `error`: its halves, and the halves of those that raise, down
        to the inputs that raise alone. An engine that fails whatever it is given costs 2 x rows - 2 runs more
        (the rows computed about log2(rows) times over; such failures are raised at once, in practice) before
        the batch fails whole with `error`."""
        rows: list[Embeddings | None] = [None] * len(batch)
        failed: dict[int, Exception] = {}
        seconds, cells, real = 0.0, 0, 0
        spans = [(0, len(batch), error)]
        while spans:
            start, end, err = spans.pop()
            if end - start == 1:
                failed[start] = err
                continue
            mid = (start + end) // 2
            for a, b in ((start, mid), (mid, end)):
                try:
                    out, s, c, r = self._run_once(batch[a:b], beside)
                except Exception as e:
                    spans.append((a, b, e))
                    continue
                rows[a:b] = list(out)
                seconds, cells, real = seconds + s, cells + c, real + r
        if len(failed) == len(batch):
            raise error
        width = next(r for r in rows if r is not None).shape[0]
        zeros = np.zeros(width, dtype=np.float32)
        out = np.stack([zeros if r is None else r for r in rows])
        return out, seconds, cells, real, failed

    def _finish(self, batch: list[Seq], run: asyncio.Future[Ran], outcome: Ran | BaseException) -> None:
        """On the loop, in the turn the inference thread wakes it: the batch's requests get their rows, then
        `run` its outcome. Resolved here rather than by the worker once `run` wakes it, their handlers run in
        the next turn, one turn of the loop sooner. Nothing when `run` is settled already: cancelled (the
        server stopped) or failed while it waited for a thread; a batch the watchdog failed finds its
        requests answered (_resolve skips them). Whatever _resolve raises settles `run`, as an engine error
        would, so that the worker fails the batch's requests and goes on rather than waiting for ever."""
        if not run.done() and isinstance(outcome, Ran):
            try:
                self._resolve(batch, outcome)
            except Exception as e:
                outcome = e
        _settle(run, outcome)

    def _observe(self, ran: Ran) -> None:
        self.metrics.inference.observe(ran.seconds)
        self.metrics.batch_size.observe(ran.rows)
        self.metrics.batch_tokens.observe(ran.cells)
        self.metrics.padding_fraction.observe(1.0 - ran.real / ran.cells)

    def _resolve(self, batch: list[Seq], ran: Ran) -> None:
        embeddings = ran.embeddings
        done = 0
        for row, s in enumerate(batch):
            job = s.job
            if job.future.done():  # cancelled, or failed in another batch
                continue
            if (error := ran.failed.get(row)) is not None:
                log.error("inference failed on input %d of request %s, in a batch of %d: %s: %s",
                          s.index, job.request_id or "-", len(batch), type(error).__name__, error)  # fmt: skip
                what = (
                    "was NaN or infinite" if isinstance(error, NonFiniteOutput) else f"failed ({type(error).__name__})"
                )
                self._fail(job, Internal(f"inference on input {s.index} of this request {what}"))
                continue
            if job.out is None:
                job.out = np.empty((job.n, embeddings.shape[1]), dtype=np.float32)
            # Its inputs may be in several batches, which two workers may compute at once.
            job.last = max(job.last, ran.ended)
            job.out[s.index] = embeddings[row]
            job.remaining -= 1
            done += 1
            if job.remaining == 0:
                job.future.set_result(job.out)
        self.metrics.inputs.inc(done)
