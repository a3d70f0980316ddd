"""Bidirectional streams that answer in order: the one loop behind encoder.v1's EncodeStream and KServe's
ModelStreamInfer.

Up to `window` requests of a stream are computed at once (so they batch together, with each other and
with other clients'), and their responses are sent in request order. With `share` (each request's part of
half its model's queue: `DataPlane.queue_share`), those computing at once take half the queue at most, one
request at least: a stream of large requests filled the queue by itself once (32 requests of 64 inputs were
a CPU's whole default queue), refusing other clients' requests, or its own where the queue was smaller.
A request that fails gets an error response (`on_error`) and the stream goes on, a bug's (an exception not
a ServiceError) too, as INTERNAL with its traceback in the log, unless the failure concerns the whole stream
(cancelled, past its deadline, or a server that is going away): then the stream ends with that status.
UNAVAILABLE says either: with `serving` (whether the server still takes calls), it ends the stream only when
the server no longer does; while it does, it concerns its own request (a model or version loading, a version
retired meanwhile), and one request naming a model whose load had not ended took the stream down, the answers
to every other request in it with it.
Each response is counted by the status it carries (`count`): the stream's own status is OK however many
of its requests failed, and the metrics would not see them otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from mhaserve.runtime.errors import Cancelled, DeadlineExceeded, Internal, ServiceError, Unavailable
from mhaserve.service.context import request_id
from mhaserve.service.errors import status_name, to_status

Request = TypeVar("Request")
Response = TypeVar("Response")

WINDOW = 32
# These end a stream with their status (UNAVAILABLE too, but see `serving`); any other failed request gets an
# error response.
FATAL = (Cancelled, DeadlineExceeded, Unavailable)

log = logging.getLogger(__name__)


def _ends_stream(error: ServiceError, serving: Callable[[], bool] | None) -> bool:
    """Whether a request's failure ends its stream: FATAL's, but an UNAVAILABLE while the server still takes
    calls, which is its own request's (see the module docstring)."""
    if isinstance(error, Unavailable) and serving is not None and serving():
        return False
    return isinstance(error, FATAL)


async def ordered(
    requests: AsyncIterator[Request],
    compute: Callable[[Request], Awaitable[Response]],
    on_error: Callable[[Request, ServiceError], Response],
    *,
    window: int = WINDOW,
    count: Callable[[str], None] | None = None,
    share: Callable[[Request], float] | None = None,
    serving: Callable[[], bool] | None = None,
) -> AsyncIterator[Response]:
    """Each request's response, in request order; see the module docstring."""
    # `space` holds the window: a request's computation starts only once there is room for it, and every one
    # started is in `pending`, where the end of the stream finds it to cancel. (Started before waiting for
    # room in a bounded queue, the one waiting was lost when the stream was cancelled, and still reached the
    # model; the window was 33 or 34.) `shares` holds the share of each request computing, summed afresh
    # each time (a running float total could drift above 0 with none left, and wait for ever).
    space = asyncio.Semaphore(window)
    pending: asyncio.Queue[tuple[Request, asyncio.Future[Response]] | None] = asyncio.Queue()
    shares: dict[asyncio.Future[Response], float] = {}
    ended = asyncio.Event()  # a request's computation ended: room, perhaps, for the next one's share

    async def read() -> None:
        try:
            async for request in requests:
                await space.acquire()
                if share is not None:
                    need = share(request)
                    while shares and sum(shares.values()) + need > 1:
                        ended.clear()
                        await ended.wait()
                task = asyncio.ensure_future(compute(request))
                if share is not None:
                    shares[task] = need
                pending.put_nowait((request, task))
        finally:
            pending.put_nowait(None)

    reader = asyncio.ensure_future(read())
    cancelled_with: tuple[object, ...] = ()  # the message the stream's own cancellation carries, if any
    try:
        while (item := await pending.get()) is not None:
            request, task = item
            try:
                response = await task
            except ServiceError as e:
                if _ends_stream(e, serving):
                    raise
                if count is not None:
                    count(status_name(e))
                yield on_error(request, e)
            except Exception as e:
                # A bug in one request's computation: it ended the stream once, with the requests after it
                # unanswered. As a unary call's, it is answered INTERNAL, pointing to its traceback in the log.
                log.error("a request of a stream failed", exc_info=e)
                if count is not None:
                    count("INTERNAL")
                yield on_error(request, Internal(to_status(e, request_id.get())[1]))
            else:
                if count is not None:
                    count("OK")
                yield response
            finally:
                space.release()
                shares.pop(task, None)
                ended.set()
        await reader  # re-raises a failure to read the stream
    except asyncio.CancelledError as e:
        # Passed on to the requests it leaves: the grace period's end (errors.ABANDONED) counts each of them as
        # their client is answered, UNAVAILABLE, where a bare cancel counted all but the first CANCELLED.
        cancelled_with = e.args
        raise
    finally:
        reader.cancel()
        while not pending.empty():
            if (left := pending.get_nowait()) is not None:
                task = left[1]
                if task.done():  # its failure is the stream's end, not news: retrieved, so asyncio logs nothing
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        task.result()
                else:
                    task.cancel(*cancelled_with)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
