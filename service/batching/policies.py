"""Batching policies: which waiting sequences form the next batch.

"length" anchors each batch on the next sequence of the request whose turn it is (the waiting requests
take turns, newcomers first, so nothing starves and a query does not wait behind all of a large request's
inputs) and grows it with the sequences nearest in length while its padding stays under a cap; "arrival"
takes sequences strictly in order (the baseline to compare against).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from operator import attrgetter
from typing import Literal, Protocol

from mhaserve.service.batching.queue import Live, Seq

Batching = Literal["length", "arrival"]
BATCHING = ("length", "arrival")


class Policy(Protocol):
    """Holds the waiting sequences and hands out batches of them."""

    def push(self, seqs: Sequence[Seq]) -> None:
        """Queue one request's sequences, in order."""

    def first(self, live: Live) -> Seq | None:
        """The live sequence the next batch starts from (None when none waits); dead ones are dropped."""

    def take(self, budget: int, live: Live, max_rows: int | None = None) -> list[Seq]: ...

    def gives_way(self, batch: Sequence[Seq], n: int) -> bool:
        """Whether `batch`, taken and still waiting for a thread, should go back for a newcomer of `n` inputs."""

    def put_back(self, seqs: Sequence[Seq]) -> None:
        """Queue again the live sequences of a batch that gave way, to be taken before those that waited."""

    def clear(self) -> None: ...


class ArrivalOrder:
    """Sequences in the order they came, while the padded batch fits the budget."""

    def __init__(self) -> None:
        self._queue: deque[Seq] = deque()

    def push(self, seqs: Sequence[Seq]) -> None:
        self._queue.extend(seqs)

    def first(self, live: Live) -> Seq | None:
        q = self._queue
        while q and not live(q[0]):
            q.popleft()
        return q[0] if q else None

    def take(self, budget: int, live: Live, max_rows: int | None = None) -> list[Seq]:
        q, batch, longest = self._queue, list[Seq](), 0
        while q and (max_rows is None or len(batch) < max_rows):
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

    def gives_way(self, batch: Sequence[Seq], n: int) -> bool:
        return False  # strictly in order: nothing goes before what came first

    def put_back(self, seqs: Sequence[Seq]) -> None:
        self._queue.extendleft(reversed(seqs))

    def clear(self) -> None:
        self._queue.clear()


_key = attrgetter("key")


class _Turns:
    """One waiting request's sequences, in order, and when its next turn to anchor a batch is due."""

    __slots__ = ("seqs", "due")

    def __init__(self, seqs: Sequence[Seq]) -> None:
        self.seqs = deque(seqs)
        self.due = 0  # the count of newcomers' turns from which this request goes before newcomers


def _head(q: deque[_Turns], live: Live) -> Seq | None:
    """The first live sequence of the first request in `q` that has one; dead ones and spent requests go."""
    while q:
        seqs = q[0].seqs
        while seqs and not live(seqs[0]):
            seqs.popleft()
        if seqs:
            return seqs[0]
        q.popleft()
    return None


class LengthAware:
    """The next sequence of the request whose turn it is, plus the waiting sequences nearest to it in length.

    The waiting requests take turns to anchor a batch. A request anchors its first batch in the order the
    requests came (newcomers); a request that anchored one and has sequences left goes behind the newcomers
    waiting then, or, when none waits, behind the next one to come, and among those that anchored before it
    in turn (round robin). With one input a request (the usual traffic) that is arrival order, the oldest
    first. With a large request waiting (an indexing job's 64 texts), a query that comes meanwhile anchors
    the next batch to form instead of waiting for all 64: docs/benchmarks.md measured a query's mean latency
    on 2 cores beside one such client at 0.64x and beside two at 0.67x what strictly oldest first gave. A
    newcomer going before a request that had its turn is what Linux's fq_codel does for new flows; the
    bound on how many go before it keeps a stream of newcomers from starving it: a request anchors within
    as many batches as there were requests waiting when it last did (at least one), and the windows take
    its sequences whenever their lengths fit.

    A list kept sorted by length holds every waiting sequence; the batch is a window of it around the
    anchor, grown one sequence at a time on the side that adds the least padding, while the batch fits the
    token budget and its padding stays within `max_padding` (a fraction of its tokens). The window passes
    over the inputs of requests larger (in inputs) than the anchor's: a query's batch holds queries, and is
    done in the time of a few, where with a bulk request's inputs of its length it ran on one core for the
    time of a dozen; a large request's batch takes smaller requests' inputs, which gain by it. Beside bulk
    clients that took a query's mean latency to 0.76x and 0.67x again, and cost the bulk clients nothing.
    The budget alone is not enough: when it is larger than the queue, every waiting sequence fits, and
    a batch of ten-token queries is padded to the one 256-token paragraph among them.
    """

    def __init__(self, max_padding: float = 1.0) -> None:
        self.max_padding = max_padding
        # Waiting requests, taken or dead sequences dropped lazily: those yet to anchor a batch in the order
        # they came, and those that anchored one, in turn.
        self._new: deque[_Turns] = deque()
        self._old: deque[_Turns] = deque()
        self._new_turns = 0  # batches newcomers anchored, ever: the clock `_Turns.due` counts on
        self._sorted: list[Seq] = []

    def push(self, seqs: Sequence[Seq]) -> None:
        if seqs:
            self._new.append(_Turns(seqs))
        for s in seqs:
            bisect.insort(self._sorted, s, key=_key)

    def _next(self, live: Live) -> deque[_Turns] | None:
        """The list whose first request anchors the next batch (None when nothing waits)."""
        new, old = _head(self._new, live), _head(self._old, live)
        if old is None:
            return self._new if new is not None else None
        return self._old if new is None or self._new_turns >= self._old[0].due else self._new

    def first(self, live: Live) -> Seq | None:
        q = self._next(live)
        return q[0].seqs[0] if q else None

    def _fits(self, rows: int, width: int, real: int, budget: int) -> bool:
        """Would a batch of `rows` sequences, padded to `width`, holding `real` tokens, be allowed?"""
        padded = rows * width
        return padded <= budget and padded - real <= self.max_padding * padded

    def take(self, budget: int, live: Live, max_rows: int | None = None) -> list[Seq]:
        q = self._next(live)
        if q is None:
            self._sorted.clear()  # only dead entries can be left
            return []
        turns = q.popleft()
        anchor = turns.seqs.popleft()
        if q is self._new:
            self._new_turns += 1
        if turns.seqs:  # its next turn: after the newcomers waiting now, or the next to come
            turns.due = self._new_turns + max(1, len(self._new))
            self._old.append(turns)
        srt = self._sorted
        i = bisect.bisect_left(srt, anchor.key, key=_key)
        batch, longest, real = [anchor], anchor.length, anchor.length
        left, right = i - 1, i + 1
        passed: list[Seq] = []  # live inputs of larger requests than the anchor's, inside the window

        def joins(s: Seq) -> bool:
            if not live(s):
                return False
            if s.job.n > anchor.job.n:
                passed.append(s)
                return False
            return True

        while True:
            while left >= 0 and not joins(srt[left]):
                left -= 1
            while right < len(srt) and not joins(srt[right]):
                right += 1
            rows = len(batch) + 1
            if max_rows is not None and rows > max_rows:
                break
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
        srt[left + 1 : right] = sorted(passed, key=_key)  # the window less the batch and the dead
        return batch

    def gives_way(self, batch: Sequence[Seq], n: int) -> bool:
        """A batch of larger requests' inputs only, formed ahead, gives way to a newcomer of fewer inputs: the
        newcomer anchors the next batch, which would otherwise start only after this one. Once: a batch of
        inputs that gave way before keeps its place, so that a stream of queries cannot hold a large request
        back for more than one batch each time it anchors."""
        return all(s.job.n > n and not s.returned for s in batch)

    def put_back(self, seqs: Sequence[Seq]) -> None:
        """Each request's returned sequences take the next turn after the newcomers waiting now, before the
        requests that had their turn (they had theirs, and gave it up)."""
        by_job: dict[int, list[Seq]] = {}
        for s in seqs:
            s.taken = False
            s.returned = True
            by_job.setdefault(id(s.job), []).append(s)
            bisect.insort(self._sorted, s, key=_key)
        due = self._new_turns + max(1, len(self._new))
        for group in reversed(by_job.values()):
            turns = _Turns(sorted(group, key=attrgetter("index")))
            turns.due = due
            self._old.appendleft(turns)

    def clear(self) -> None:
        self._new.clear()
        self._old.clear()
        self._sorted.clear()


def make_policy(batching: Batching, max_padding: float) -> Policy:
    return LengthAware(max_padding) if batching == "length" else ArrivalOrder()
