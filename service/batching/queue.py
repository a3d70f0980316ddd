"""What waits in the batcher's queue: one job per request, one sequence per input, tickets for slots held."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

Ids = npt.NDArray[np.int64]
Embeddings = npt.NDArray[np.float32]


class Job:
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
        "first",
        "last",
    )

    def __init__(self, future: asyncio.Future[Embeddings], n: int, deadline: float | None, request_id: str) -> None:
        self.future = future
        self.n = self.remaining = self.queued = n
        self.queued_tokens = 0
        self.out: Embeddings | None = None
        self.deadline = deadline  # on the event loop's clock
        self.request_id = request_id
        self.enqueued = time.perf_counter()
        # When the engine began the first batch that held one of its inputs (stamped by the thread that began
        # it: Batcher._begin), and ended the last (perf_counter; 0.0 until one has): the request's time in the
        # queue and in the model (Spent).
        self.first = 0.0
        self.last = 0.0


class Spent:
    """Where a request's time went in the batcher, in seconds: queued until the engine began its first input
    (a batch formed ahead counts as queued while it waits for a thread), then until the engine ended its
    last. Filled in by `Batcher.submit` once the request is answered, the queue time the one the queue-wait
    histogram observed (Batcher._begin); what TEI's clients read as the queue and inference times."""

    __slots__ = ("queue", "inference")

    def __init__(self) -> None:
        self.queue = 0.0
        self.inference = 0.0


class Seq:
    """One input of a request, as the policies see it: its ids, its length, whether a batch took it."""

    __slots__ = ("job", "index", "ids", "length", "key", "taken", "returned")

    def __init__(self, job: Job, index: int, ids: Ids, order: int) -> None:
        self.job = job
        self.index = index
        self.ids = ids
        self.length = int(ids.shape[0])
        self.key = (self.length, order)  # order breaks ties, so keys are unique
        self.taken = False
        self.returned = False  # its batch gave way to a smaller request once (policies.LengthAware.gives_way)


# Whether a sequence still wants computing (its request neither answered nor cancelled nor expired).
Live = Callable[[Seq], bool]


class Ticket:
    """Queue slots held for one request between admission and queueing (while it is tokenised)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n
