"""Batching policies: which waiting sequences form the next batch.

"length" anchors each batch on the next sequence of the request with the fewest inputs left (so requests are
answered one after another and a query does not wait behind a large request's inputs; one passed over long
enough goes first, so nothing starves) and grows it with the sequences nearest in length while its padding
stays under a cap; "arrival" takes sequences strictly in order (the baseline to compare against).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Literal, Protocol

from mhaserve.service.batching.queue import Job, Live, Seq

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
_ripe = attrgetter("ripe")
_left = attrgetter("left")
_index = attrgetter("index")


class _Waiting:
    """One waiting request: its sequences in order (those taken or dead dropped lazily from the front), how many
    of them no batch has taken, when it came, and from which batch on it goes before the others (aging)."""

    __slots__ = ("job", "seqs", "left", "order", "ripe")

    def __init__(self, seqs: Sequence[Seq], ripe: int) -> None:
        self.job = seqs[0].job
        self.seqs = deque(seqs)
        self.left = len(seqs)
        self.order = seqs[0].key[1]  # a request's sequences are numbered together as it comes: its arrival
        self.ripe = ripe

    def head(self, live: Live) -> Seq | None:
        """Its first live sequence (None when it has none left)."""
        seqs = self.seqs
        while seqs and not live(seqs[0]):
            seqs.popleft()
        return seqs[0] if seqs else None


class LengthAware:
    """The next sequence of the request with the fewest inputs left, plus the waiting sequences nearest to it in
    length.

    The request with the fewest inputs that no batch has taken yet anchors the next batch, the oldest among
    equals: the requests are answered one after another. Eight requests of 16 inputs queued together are
    answered an eighth of the work apart, the first after its own inputs; when the requests took turns
    (processor sharing) none was answered until nearly all were computed, and a client's deadline or a
    drain's grace period failed nearly every one after most of its inputs were computed (docs/benchmarks.md).
    A query (one input) that comes while a large request waits (an indexing job's 64 texts) anchors the next
    batch to form instead of waiting for all 64: docs/benchmarks.md measured a query's mean latency on 2
    cores beside one such client at 0.64x and beside two at 0.67x what strictly oldest first gave. A request
    of 16 inputs behind one of 64 is answered after its own batches. With one input a request (the usual
    traffic) this is arrival order, the oldest first.

    Fewest left first alone would starve a large request under a stream of smaller ones. So a request passed
    over for as many batches as other inputs waited when it came or last anchored a batch (at least one) goes
    before every other, those due earliest first: it waits no more batches than those inputs would take one a
    batch, plus one for each request that came due before it; a request that came alone lets one newcomer go
    first. A bound of as many batches as requests waiting would be the turns again, as equal requests would
    each come due in turn.

    A list kept sorted by length holds every waiting sequence; the batch is a window of it around the
    anchor, grown one sequence at a time on the side that adds the least padding (on a tie, the side holding
    the anchor's request's own, which then ends sooner), while the batch fits the token budget and its
    padding stays within `max_padding` (a fraction of its tokens). The window passes over the inputs of
    requests larger (in inputs) than the anchor's: a query's batch holds queries, and is done in the time of
    a few, where with a bulk request's inputs of its length it ran on one core for the time of a dozen; a
    large request's batch takes smaller requests' inputs, which gain by it. Beside bulk clients that took a
    query's mean latency to 0.76x and 0.67x again, and cost the bulk clients nothing. The budget alone is
    not enough: when it is larger than the queue, every waiting sequence fits, and a batch of ten-token
    queries is padded to the one 256-token paragraph among them.
    """

    def __init__(self, max_padding: float = 1.0) -> None:
        self.max_padding = max_padding
        self._waiting: dict[Job, _Waiting] = {}  # every request with sequences no batch has taken
        # The same requests in two heaps, by the batch from which they go first and by inputs left, the oldest
        # first among equals; a request is entered again whenever either changes, and an entry no longer true
        # (or of a request gone) is dropped when it comes to the top. With 2,000 single-text requests queued,
        # scanning the requests for each batch cost 1.7 ms a batch, the heaps 0.07 ms (the turns: 0.04 ms).
        self._by_ripe: list[tuple[int, int, int, _Waiting]] = []
        self._by_left: list[tuple[int, int, int, _Waiting]] = []
        self._entries = itertools.count()  # ties: a request's entry made again when its batch gave way
        self._batches = 0  # batches taken, ever: the clock `_Waiting.ripe` counts on
        self._sorted: list[Seq] = []

    def push(self, seqs: Sequence[Seq]) -> None:
        if seqs:
            self._rank(_Waiting(seqs, self._batches + max(1, len(self._sorted))))
        for s in seqs:
            bisect.insort(self._sorted, s, key=_key)

    def _rank(self, w: _Waiting) -> None:
        """Enter `w` (new, or its ripe or left changed) in the heaps; rebuild them when mostly stale."""
        self._waiting[w.job] = w
        heapq.heappush(self._by_ripe, (w.ripe, w.order, next(self._entries), w))
        heapq.heappush(self._by_left, (w.left, w.order, next(self._entries), w))
        if len(self._by_ripe) + len(self._by_left) > 4 * len(self._waiting) + 128:
            self._by_ripe = [(w.ripe, w.order, next(self._entries), w) for w in self._waiting.values()]
            self._by_left = [(w.left, w.order, next(self._entries), w) for w in self._waiting.values()]
            heapq.heapify(self._by_ripe)
            heapq.heapify(self._by_left)

    def _top(self, heap: list[tuple[int, int, int, _Waiting]], rank: Callable[[_Waiting], int]) -> _Waiting | None:
        """The request first in `heap` by `rank` (None when none waits); entries no longer true go."""
        while heap:
            key, _, _, w = heap[0]
            if rank(w) == key and self._waiting.get(w.job) is w:
                return w
            heapq.heappop(heap)
        return None

    def _next(self, live: Live) -> _Waiting | None:
        """The request that anchors the next batch (None when nothing waits); those found dead go."""
        while True:
            w = self._top(self._by_ripe, _ripe)
            if w is None or w.ripe > self._batches:
                w = self._top(self._by_left, _left)
            if w is None or w.head(live) is not None:
                return w
            del self._waiting[w.job]  # cancelled or expired: its sequences in the sorted list go with a window

    def first(self, live: Live) -> Seq | None:
        w = self._next(live)
        return w.seqs[0] if w else None

    def _fits(self, rows: int, width: int, real: int, budget: int) -> bool:
        """Would a batch of `rows` sequences, padded to `width`, holding `real` tokens, be allowed?"""
        padded = rows * width
        return padded <= budget and padded - real <= self.max_padding * padded

    def take(self, budget: int, live: Live, max_rows: int | None = None) -> list[Seq]:
        w = self._next(live)
        if w is None:
            self._sorted.clear()  # only dead entries can be left
            return []
        anchor = w.seqs.popleft()
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
            if fit_left and fit_right:
                more_left, more_right = longest - srt[left].length, (srt[right].length - longest) * len(batch)
                # Of equal lengths, the older requests' lie to the left: the anchor's own go first instead.
                go_left = more_left < more_right or (more_left == more_right and srt[right].job is not anchor.job)
            else:
                go_left = fit_left
            if go_left:
                batch.append(srt[left])
                real += srt[left].length
                left -= 1
            else:
                batch.append(srt[right])
                longest = srt[right].length
                real += longest
                right += 1
        srt[left + 1 : right] = sorted(passed, key=_key)  # the window less the batch and the dead
        changed: dict[Job, _Waiting] = {}
        for s in batch:
            s.taken = True
            changed[s.job] = owner = self._waiting[s.job]
            owner.left -= 1
        self._batches += 1
        w.ripe = self._batches + max(1, len(srt) - w.left)
        for job, owner in changed.items():
            if owner.left:
                self._rank(owner)
            else:
                del self._waiting[job]
        return batch

    def _left(self, job: Job) -> int:
        w = self._waiting.get(job)
        return w.left if w else 0

    def gives_way(self, batch: Sequence[Seq], n: int) -> bool:
        """A batch formed ahead gives way to a newcomer of fewer inputs than each of the batch's requests has left
        (this batch's among them): the newcomer, which would have anchored had it come before the batch was
        formed, anchors the next batch, which would otherwise start only after this one. Once: a batch of
        inputs that gave way before keeps its place, so that a stream of queries cannot hold a large request
        back for more than one batch each time it anchors."""
        if any(s.returned for s in batch):
            return False
        in_batch: dict[Job, int] = {}
        for s in batch:
            in_batch[s.job] = in_batch.get(s.job, 0) + 1
        return all(k + self._left(job) > n for job, k in in_batch.items())

    def put_back(self, seqs: Sequence[Seq]) -> None:
        """Each request's returned sequences wait again with its others; having given up a batch, it goes before
        the others once the newcomer's batch is taken."""
        by_job: dict[Job, list[Seq]] = {}
        for s in seqs:
            s.taken = False
            s.returned = True
            bisect.insort(self._sorted, s, key=_key)
            by_job.setdefault(s.job, []).append(s)
        for job, group in by_job.items():
            w = self._waiting.get(job)
            if w is None:
                w = _Waiting(sorted(group, key=_index), self._batches + 1)
            else:
                w.seqs = deque(sorted([*w.seqs, *group], key=_index))
                w.left += len(group)
                w.ripe = min(w.ripe, self._batches + 1)
            self._rank(w)

    def clear(self) -> None:
        self._waiting.clear()
        self._by_ripe.clear()
        self._by_left.clear()
        self._sorted.clear()


def make_policy(batching: Batching, max_padding: float) -> Policy:
    return LengthAware(max_padding) if batching == "length" else ArrivalOrder()
