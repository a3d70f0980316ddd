"""The inference watchdog: a bound on how long one batch may compute (`--inference-timeout`).

The bound runs from when a thread starts the batch, not from when it was formed: a batch may wait for a
thread first (the one formed ahead with several workers, or one of a model whose threads other models
share), and that wait is not the engine hanging. A batch past the bound fails its requests with
UNAVAILABLE (HTTP 504), the queue is failed (UNAVAILABLE, HTTP 503: it never ran) and new work refused,
and `on_stall` tells the server, which reports NOT_SERVING. A thread cannot be stopped from outside, so
the batch keeps the inference thread until the engine returns (if ever); when it does, `on_recover` tells
the server, and batches run again. The return is awaited apart from the batch's worker: a batcher closed
meanwhile (its version unloaded or replaced) cancels its workers, and the server must still hear of it.
With several inference workers, each stalled batch calls both hooks once, and `stalled` holds until the
last of them has returned.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from mhaserve.runtime.errors import InferenceTimeout, ServiceError

log = logging.getLogger(__name__)

Hook = Callable[[], Awaitable[None]]
T = TypeVar("T")


class Watchdog:
    """Guards each batch's engine call; `stalled` while one has overrun and not yet returned."""

    def __init__(self, timeout: float | None, on_stall: Hook | None = None, on_recover: Hook | None = None) -> None:
        self.timeout = timeout or None  # 0: no watchdog
        self.on_stall = on_stall
        self.on_recover = on_recover
        self._stalled = 0  # batches past the bound whose engine call has not returned
        self._recovering: set[asyncio.Task[None]] = set()  # each waits for one of them to return

    @property
    def stalled(self) -> bool:
        return self._stalled > 0

    def message(self) -> str:
        return (
            f"the model has not answered for more than {self.timeout:g} s (--inference-timeout); "
            "this server reports NOT_SERVING: retry on another replica"
        )

    async def guard(
        self,
        run: asyncio.Future[T],
        *,
        begun: Sequence[float],
        size: int,
        request_ids: str,
        fail: Callable[[ServiceError], None],
        thread: Future[None],
    ) -> T | None:
        """The batch's result, or None when it overran: then `fail` has failed its requests and the queue,
        and this returns only once the engine call has (its worker runs nothing meanwhile). `begun` is empty
        until the batch's thread starts it, then holds that time (time.monotonic()); `thread` is the call on
        the inference thread, done when the engine has returned, whoever still waits for `run`.

        The bound is a timer beside a plain `await run`, not `asyncio.wait(timeout=)`: that wait costs every
        batch one more turn of the event loop (and a future) between the result and its requests. The timer
        is set for a timeout after the batch was formed, since most batches start at once; when it fires on
        one that started later, it is set again for the rest of the bound (the thread writes the time it
        started, so the loop is not woken for it). A batch that waited a whole timeout for a thread is
        looked at again every eighth of one until it starts.
        """
        if self.timeout is None:
            return await run
        timeout = self.timeout
        loop = asyncio.get_running_loop()
        recovered: asyncio.Future[None] | None = None  # set when the batch overruns: its recovery, under way
        timer: asyncio.TimerHandle

        def check() -> None:
            nonlocal recovered, timer
            if run.done():  # a result that came in the same turn as the timer wins
                return
            left = begun[0] + timeout - time.monotonic() if begun else timeout / 8
            if left > 0:
                timer = loop.call_later(left, check)
            else:
                recovered = self._overran(begun[0], size, request_ids, fail, run, thread)

        timer = loop.call_later(timeout, check)
        try:
            result: T | None = await run
        except Exception:
            if recovered is None:
                raise
            result = None  # its requests have their answer already; the recovery's log says it failed
        finally:
            timer.cancel()
        if recovered is None:
            return result
        # Shielded: a worker cancelled here (its batcher closed) leaves the recovery to finish on its own.
        await asyncio.shield(recovered)
        return None

    def _overran(
        self,
        started: float,
        size: int,
        request_ids: str,
        fail: Callable[[ServiceError], None],
        run: asyncio.Future[T],
        thread: Future[None],
    ) -> asyncio.Future[None]:
        """Fail the batch and the queue, tell the server (`on_stall`); the recovery, which waits for the engine."""
        log.error(
            "inference on a batch of %d inputs has run for more than %g s (--inference-timeout); failing its "
            "requests (%s) and the queue, reporting NOT_SERVING until the engine returns",
            size,
            self.timeout,
            request_ids or "-",
        )
        self._stalled += 1
        fail(InferenceTimeout(self.message()))
        stalling = asyncio.ensure_future(self.on_stall()) if self.on_stall is not None else None
        recovered = asyncio.ensure_future(self._recover(started, stalling, run, thread))
        self._recovering.add(recovered)  # a reference: the loop keeps only weak ones to tasks
        recovered.add_done_callback(self._recovering.discard)
        return recovered

    async def _recover(
        self, started: float, stalling: asyncio.Future[None] | None, run: asyncio.Future[T], thread: Future[None]
    ) -> None:
        """Once the overrun batch's engine call has returned: the stall is over, said and told (`on_recover`)."""
        # The thread's own future, not `run`, which the worker cancels when its batcher closes. (asyncio.wait:
        # this task's own cancellation, at the loop's end, still ends it; and then the copy is cancelled, so
        # that the thread's return finds nothing to hand to a loop that may be closed.)
        returned = asyncio.wrap_future(thread)
        try:
            await asyncio.wait([returned])
        finally:
            returned.cancel()
        if stalling is not None:
            await stalling
        self._stalled -= 1
        failed = run.done() and not run.cancelled() and run.exception() is not None
        log.warning(
            "the stalled batch returned after %.1f s (%s); %s",
            time.monotonic() - started,
            "failed" if failed else "its results were discarded",
            f"{self._stalled} other stalled batch(es) still running" if self.stalled else "accepting requests again",
        )
        if self.on_recover is not None:
            await self.on_recover()
