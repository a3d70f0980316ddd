"""The batcher alone: against a plain loop, its policies' batches, splitting, expiry, drain, close, and
several workers."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.errors import DeadlineExceeded, InferenceTimeout, Internal, ResourceExhausted, Unavailable
from mhaserve.runtime.manifest import read_manifest
from mhaserve.service.batching import Batcher, Limits, Spent
from mhaserve.service.batching import batcher as batcher_module
from mhaserve.service.batching.padding import pad
from mhaserve.service.batching.queue import Live, Seq
from mhaserve.service.context import RequestIdFilter, request_id
from mhaserve.service.metrics import Metrics, ModelMetrics
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.loopback import WAIT, wait_until
from mhaserve.testing.metrics import from_registry

T = TypeVar("T")


def limits(**kw: Any) -> Limits:
    base = {
        "max_batch_tokens": 400,
        "max_wait_ms": 60_000.0,
        "max_queue_size": 1000,
        "max_client_batch_size": 64,
        "max_padding": 1.0,  # no cap unless a test asks for one
    }
    return Limits(**(base | kw))


def run(coro: Coroutine[Any, Any, T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, WAIT)

    return asyncio.run(bounded())


def run_opening_gates(coro: Coroutine[Any, Any, T], engine: ScriptedEngine) -> T:
    """`run`, then every gate of the engine opened, whatever happened: a failed test must leave no engine
    thread waiting."""
    try:
        return run(coro)
    finally:
        for gate in engine.gates.values():
            gate.set()


def seq(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def padding(batches: list[list[list[int]]]) -> float:
    total = sum(len(b) * max(map(len, b)) for b in batches)
    return 1 - sum(len(r) for b in batches for r in b) / total


@pytest.mark.parametrize("batching", ["length", "arrival"])
def test_batched_results_equal_a_plain_loop(tiny_entry: Path, batching: str) -> None:
    """The honest check: many requests of random lengths, batched, against each input run alone."""
    m = read_manifest(tiny_entry)
    engine = OnnxEngine(tiny_entry / "model.onnx", max_seq_len=m.max_seq_len, vocab_size=m.vocab_size, device="cpu")
    rng = np.random.default_rng(0)
    requests = [
        [rng.integers(0, m.vocab_size, size=rng.integers(1, m.max_seq_len + 1)).astype(np.int64) for _ in range(k)]
        for k in rng.integers(1, 6, size=40)
    ]

    async def main() -> tuple[list[np.ndarray], float]:
        b = Batcher(engine, limits=limits(max_batch_tokens=1024, max_wait_ms=5.0), batching=batching)  # type: ignore[arg-type]
        b.start()
        try:
            out = await asyncio.gather(*(b.submit(r) for r in requests))
        finally:
            await b.close()
        sizes = b.metrics.parent.registry
        labels = {"model": "-", "version": "0"}
        mean = (sizes.get_sample_value("mhaserve_batch_size_sum", labels) or 0) / (
            sizes.get_sample_value("mhaserve_batch_size_count", labels) or 1
        )
        return out, mean

    results, mean_batch = run(main())
    assert mean_batch > 1  # it did batch
    for request, got in zip(requests, results, strict=True):
        alone = np.stack([engine.run(s[None, :], np.ones((1, len(s)), dtype=np.int64))[0] for s in request])
        assert np.abs(got - alone).max() <= 1e-5


def _batches(batching: str, lengths: list[int], **kw: Any) -> list[list[list[int]]]:
    """The batches formed when all of `lengths` (one request each, first id = request number) wait together."""
    engine = ScriptedEngine()

    async def main() -> None:
        b = Batcher(engine, limits=limits(**({"max_batch_tokens": 400} | kw)), batching=batching)  # type: ignore[arg-type]
        calls = [asyncio.ensure_future(b.submit([seq(i, *[7] * (n - 1))])) for i, n in enumerate(lengths)]
        await asyncio.sleep(0)  # every request queued before the worker looks
        b.drain()  # no waiting for a full batch: the tail goes out as it is
        b.start()
        await asyncio.gather(*calls)
        await b.close()

    run(main())
    return engine.batches


def test_length_aware_groups_similar_lengths_and_serves_the_oldest_first() -> None:
    lengths = [100, 3] * 10
    by_length, by_arrival = _batches("length", lengths), _batches("arrival", lengths)
    assert [r[0] for r in by_arrival[0]] == [0, 1, 2, 3]  # arrival order: 100, 3, 100, 3
    assert [r[0] for r in by_length[0]] == [0, 2, 4, 6]  # the oldest, with the other 100s
    assert [len(r) for r in by_length[1]] == [3] * 10  # then the next oldest, a short one, with all its kind
    assert padding(by_length) < 0.05 < padding(by_arrival)
    assert sorted(r[0] for b in by_length for r in b) == list(range(20))


@pytest.mark.parametrize("batching", ["length", "arrival"])
def test_an_input_longer_than_the_budget_is_a_batch_alone(batching: str) -> None:
    """The CPU's default budget (256 tokens) is below some models' longest input (512): such an input is
    computed, alone, and the short ones beside it still batch together."""
    batches = _batches(batching, [3, 50, 3, 3], max_batch_tokens=16)
    assert sorted(r[0] for b in batches for r in b) == [0, 1, 2, 3]
    assert [[r[0] for r in b] for b in batches if any(len(r) == 50 for r in b)] == [[1]]
    assert max(len(b) for b in batches) >= 2  # the 3-token inputs share a batch: the budget still batches


@pytest.mark.parametrize("batching", ["length", "arrival"])
def test_a_query_queued_behind_a_large_request_anchors_the_first_batch(batching: str) -> None:
    """The length policy anchors each batch on the request with the fewest inputs left: a lone query queued
    behind a request of 16 inputs anchors the first batch, and alone (its window passes over the larger
    request's inputs), where strictly oldest first (and arrival order, the baseline) put it in the fifth,
    after all 16, and the requests taking turns in the second. Every input is computed once either way."""
    engine = ScriptedEngine()

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_batch_tokens=40), batching=batching)  # type: ignore[arg-type]
        bulk = asyncio.ensure_future(b.submit([seq(1, *[7] * 9) for _ in range(16)]))
        await asyncio.sleep(0)
        query = asyncio.ensure_future(b.submit([seq(2, *[7] * 9)]))
        await asyncio.sleep(0)  # both queued before the worker looks
        b.drain()
        b.start()
        await asyncio.gather(bulk, query)
        await b.close()

    run(main())
    firsts = [[row[0] for row in batch] for batch in engine.batches]
    assert sorted(i for batch in firsts for i in batch) == [1] * 16 + [2]
    if batching == "length":
        # With a smaller request just come, the large one's batches take half the budget: 2 rows of 10 tokens.
        assert firsts == [[2], *[[1] * 2] * 8]
    else:
        assert firsts == [[1] * 4] * 4 + [[2]]  # the budget's 4 rows of 10 tokens


def _bulk_batches(batching: str, *, query_first: bool) -> list[list[list[int]]]:
    """A request of 16 inputs of 10 tokens, alone with a 40-token budget; `query_first`: a one-text request
    came (and was answered) just before it."""
    engine = ScriptedEngine()

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_batch_tokens=40, max_wait_ms=0.0), batching=batching)  # type: ignore[arg-type]
        b.start()
        if query_first:
            await b.submit([seq(2, *[7] * 9)])
        await b.submit([seq(1, *[7] * 9) for _ in range(16)])
        await b.close()

    run(main())
    return [b for b in engine.batches if b[0][0] == 1]


@pytest.mark.parametrize("batching", ["length", "arrival"])
def test_while_smaller_requests_come_a_larger_requests_batch_takes_half_the_budget(
    batching: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A query that finds the workers computing waits for the first batch to end: while smaller requests come,
    a larger request's batches hold half the budget's tokens (here 2 rows of 10 tokens, not 4), with the
    length policy; arrival order, the baseline, keeps the budget. Alone, or once the smaller requests are
    older than SMALLER_RECENT_S, the budget is whole again."""
    alone = _bulk_batches(batching, query_first=False)
    assert [len(b) for b in alone] == [4] * 4
    beside = _bulk_batches(batching, query_first=True)
    assert [len(b) for b in beside] == ([2] * 8 if batching == "length" else [4] * 4)
    monkeypatch.setattr(batcher_module, "SMALLER_RECENT_S", 0.0)
    assert [len(b) for b in _bulk_batches(batching, query_first=True)] == [4] * 4


def test_a_batch_that_single_text_requests_anchor_keeps_the_whole_budget() -> None:
    """Single-text requests (the usual traffic, and a query's own batch) never halve the budget, whatever came
    before them: 8 of them waiting take the budget's 4 rows of 10 tokens a batch."""
    engine = ScriptedEngine(gates=[91])

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_batch_tokens=40, max_wait_ms=0.0))
        b.start()
        await b.submit([seq(5, 5)] * 2)  # a request of two inputs came just now
        held = asyncio.ensure_future(b.submit([seq(91)]))
        await in_engine(engine, 2)
        singles = [asyncio.ensure_future(b.submit([seq(3, *[7] * 9)])) for _ in range(8)]
        for _ in range(10):
            await asyncio.sleep(0)
        engine.gates[91].set()
        await asyncio.gather(held, *singles)
        await b.close()

    run_opening_gates(main(), engine)
    assert [len(b) for b in engine.batches if b[0][0] == 3] == [4, 4]


def test_the_length_policy_anchors_each_batch_on_the_request_with_the_fewest_inputs_left() -> None:
    """Each batch's anchor (its first sequence) comes from the request with the fewest inputs left, the oldest
    among equals. Three requests, 12 + 1 + 12 inputs, a padding cap of 0 (a batch holds one length), 4 rows a
    batch: the query B first (oldest first would have put it after A's 12), then A to its end, then C (the
    requests taking turns went A, B, C, A, C, ...), and nothing is taken twice or left behind."""
    from mhaserve.service.batching.policies import LengthAware
    from mhaserve.service.batching.queue import Job, Seq

    async def main() -> list[list[tuple[str, int]]]:
        policy = LengthAware(max_padding=0.0)
        loop, order = asyncio.get_running_loop(), iter(range(100))
        for name, n, length in (("A", 12, 5), ("B", 1, 9), ("C", 12, 5)):
            job = Job(loop.create_future(), n, None, name)
            policy.push([Seq(job, i, seq(*[i] * length), next(order)) for i in range(n)])
        batches = []
        while batch := policy.take(10_000, lambda s: not s.taken, max_rows=4):
            batches.append([(s.job.request_id, s.index) for s in batch])
        return batches

    batches = run(main())
    assert [b[0][0] for b in batches] == ["B", "A", "A", "A", "C", "C", "C"]
    assert batches[0] == [("B", 0)]
    assert sorted(s for b in batches for s in b) == sorted(
        [("A", i) for i in range(12)] + [("B", 0)] + [("C", i) for i in range(12)]
    )


Step = tuple[str, list[int]] | None


def _taken(steps: list[Step], rows: int = 4) -> list[list[tuple[str, int]]]:
    """Drive a LengthAware policy (padding cap 0: a batch holds one length; `rows` rows a batch): each step either
    queues a request (its name, its inputs' lengths) or, for None, takes a batch; each batch as (request, input)
    pairs, its anchor first."""
    from mhaserve.service.batching.policies import LengthAware
    from mhaserve.service.batching.queue import Job, Seq

    async def main() -> list[list[tuple[str, int]]]:
        policy, loop, order, batches = LengthAware(max_padding=0.0), asyncio.get_running_loop(), iter(range(10_000)), []
        for step in steps:
            if step is None:
                batch = policy.take(10_000, lambda s: not s.taken, max_rows=rows)
                batches.append([(s.job.request_id, s.index) for s in batch])
            else:
                name, lengths = step
                job = Job(loop.create_future(), len(lengths), None, name)
                policy.push([Seq(job, i, seq(*[i] * length), next(order)) for i, length in enumerate(lengths)])
        return batches

    return run(main())


def _anchors(steps: list[tuple[str, int, int] | None]) -> list[str]:
    """`_taken` with requests given as (name, inputs, length), 4 rows a batch: the name of each batch's anchor."""
    batches = _taken([None if s is None else (s[0], [s[2]] * s[1]) for s in steps])
    return [b[0][0] if b else "-" for b in batches]


def _answered(batches: list[list[tuple[str, int]]]) -> dict[str, int]:
    """Each request's last batch (counted from 1): when it would be answered."""
    return {name: n for n, batch in enumerate(batches, 1) for name, _ in batch}


def test_equal_requests_queued_together_are_answered_one_after_another() -> None:
    """Eight requests of 16 inputs queued at once (4 rows a batch): the first is answered after its own 4
    batches, the next 4 batches later, and so on, in the order they came. Taking turns (processor sharing)
    answered none until nearly all were computed: a deadline or a drain's grace failed nearly every one."""
    batches = _taken([(f"r{i}", [5] * 16) for i in range(8)] + [None] * 40)
    assert _answered(batches) == {f"r{i}": 4 * (i + 1) for i in range(8)}


def test_a_medium_request_behind_a_huge_one_is_answered_first() -> None:
    """A request of 16 inputs comes while one of 64 computes: it goes first, having fewer inputs left, and is
    answered after its own 4 batches and one of the huge request's (which came alone, so its turn comes once
    one batch passed it by); taking turns gave the huge one every other batch."""
    batches = _taken([("huge", [5] * 64), None, ("medium", [9] * 16)] + [None] * 30)
    assert [b[0][0] for b in batches if b][:7] == ["huge", "medium", "huge", "medium", "medium", "medium", "huge"]
    assert _answered(batches) == {"medium": 6, "huge": 20}


def test_a_stream_of_smaller_requests_does_not_starve_a_large_one() -> None:
    """Fewest inputs left first alone would starve a large request under a stream of smaller ones: here one of
    3 inputs comes every other batch (2 rows a batch: two batches each, one length each, so that no window
    takes one with another). A request passed over for as many batches as other inputs waited when it came
    or last anchored (at least one) anchors the next: the large one keeps its turns, and every input is
    taken once."""
    steps: list[Step] = [("large", [5] * 60)]
    for i in range(40):
        steps += [(f"s{i}", [10 + i] * 3), None, None]
    steps += [None] * 60
    batches = _taken(steps, rows=2)
    # When the large request came (before batch 0: as if it had anchored batch -1) and each batch it anchored,
    # with the other inputs waiting then.
    turns = [(-1, 0)]
    waiting, taken = 0, iter(enumerate(batches))
    for step in steps:
        if step is None:
            n, batch = next(taken)
            waiting -= sum(1 for name, _ in batch if name != "large")
            if batch and batch[0][0] == "large":
                turns.append((n, waiting))
        elif step[0] != "large":
            waiting += len(step[1])
    everything = [pair for batch in batches for pair in batch]
    assert len(everything) == len(set(everything)) == 60 + 40 * 3
    assert len(turns) == 1 + 30  # its 60 inputs, 2 a batch
    for (at, others), (then, _) in zip(turns, turns[1:], strict=False):
        assert then - at - 1 <= max(1, others)


def test_a_batch_takes_its_anchors_own_inputs_before_others_of_the_same_length() -> None:
    """r2 has 2 inputs of length 5 left (a window took its two of length 9), r1 4: r2 anchors, and its batch
    takes its own other input before r1's of the same length, so that it is answered with this batch; taking
    the nearest to the left first, the batch took three of r1's and left r2 for later."""
    batches = _taken([("z", [9] * 6), None, ("r1", [5] * 4), ("r2", [5, 5, 9, 9]), None, None, None, None])
    assert sorted(batches[1]) == [("r2", 2), ("r2", 3), ("z", 4), ("z", 5)]  # the window that took r2's two
    assert batches[2][:2] == [("r2", 0), ("r2", 1)]
    assert _answered(batches) == {"z": 2, "r2": 3, "r1": 4}


def test_a_draining_batcher_answers_the_queued_requests_one_after_another() -> None:
    """Four requests of 6 inputs queued when the server stops (drain: everything goes to the model at once),
    2 rows a batch: each is answered 3 batches after the one before, so that a grace period answers as many
    as it has time for. Taking turns, they were answered with batches 6, 9, 10 and 12."""
    engine = ScriptedEngine()

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_batch_tokens=20))
        calls = [asyncio.ensure_future(b.submit([seq(i, *[7] * 9)] * 6)) for i in range(4)]
        await asyncio.sleep(0)
        b.drain()
        b.start()
        await asyncio.gather(*calls)
        await b.close()

    run(main())
    assert {row[0]: n for n, batch in enumerate(engine.batches, 1) for row in batch} == {0: 3, 1: 6, 2: 9, 3: 12}


def test_a_request_that_had_its_turn_lets_the_next_newcomer_go_first() -> None:
    """A bulk request alone anchors batch after batch; a query that comes meanwhile anchors the next one
    (round robin alone would have put it behind the bulk request's next turn), and then the bulk goes on."""
    take = None
    assert _anchors([("bulk", 40, 5), take, take, ("query", 1, 9), take, take]) == ["bulk", "bulk", "query", "bulk"]


def test_a_small_requests_batch_passes_over_larger_requests_inputs_and_a_large_ones_takes_smaller_ones() -> None:
    """Two queries and a request of 8 inputs, all of one length (10 rows a batch, no padding cap): a query's
    batch holds the queries only, though the bulk inputs fit it; the bulk request's batch takes a query that
    waits beside it."""
    from mhaserve.service.batching.policies import LengthAware
    from mhaserve.service.batching.queue import Job, Seq

    async def main() -> list[list[str]]:
        policy, loop, order = LengthAware(), asyncio.get_running_loop(), iter(range(100))

        def push(name: str, n: int) -> None:
            job = Job(loop.create_future(), n, None, name)
            policy.push([Seq(job, i, seq(*[i] * 5), next(order)) for i in range(n)])

        def take() -> list[str]:
            return sorted(s.job.request_id for s in policy.take(10_000, lambda s: not s.taken, max_rows=10))

        for name, n in (("q1", 1), ("bulk", 8), ("q2", 1)):
            push(name, n)
        first = take()  # q1 anchors: q2 joins, none of the bulk's inputs
        push("q3", 1)
        return [first, take(), take()]  # the bulk anchors (its turn), and takes q3; then nothing waits

    assert run(main()) == [["q1", "q2"], ["bulk"] * 8 + ["q3"], []]


def test_newcomers_do_not_starve_a_request_that_had_its_turn() -> None:
    """The bulk request came alone: it lets one query go first. Then three queries wait when it anchors; its
    next turn comes after those three, though a new one arrives before every batch, and so on: it keeps
    anchoring at bounded intervals. (Each query of its own length, so that no window takes one with another.)"""
    take = None
    steps: list[tuple[str, int, int] | None] = [("bulk", 200, 5), ("n1", 1, 10), ("n2", 1, 11), ("n3", 1, 12), take]
    for i in range(4, 40):
        steps += [(f"n{i}", 1, 9 + i), take]
    anchors = _anchors(steps)
    assert anchors[:6] == ["n1", "bulk", "n2", "n3", "n4", "bulk"]
    turns = [i for i, name in enumerate(anchors) if name == "bulk"]
    # At its j-th turn 3 + j newcomers wait (each batch it anchors serves none of the one that came): its next
    # turn comes right after them (a query is one input), as when the requests took turns.
    assert len(turns) >= 6
    assert [b - a for a, b in zip(turns, turns[1:], strict=False)] == [4 + j for j in range(len(turns) - 1)]


def test_the_padding_cap_bounds_every_batch_even_when_the_budget_would_take_everything() -> None:
    """Queries and a few long paragraphs, all fitting the budget at once: uncapped, the window takes them all
    and pads the queries to the paragraphs; capped, no batch passes the cap, and nothing is lost or starved."""
    rng = np.random.default_rng(1)
    lengths = [int(n) for n in rng.choice([5, 6, 8, 9, 12, 14, 40, 44, 120, 128], size=40)]
    uncapped = _batches("length", lengths, max_batch_tokens=100_000)
    assert len(uncapped) == 1 and padding(uncapped) > 0.5
    for cap in (0.0, 0.2, 0.5):
        capped = _batches("length", lengths, max_batch_tokens=100_000, max_padding=cap)
        assert max(padding([b]) for b in capped) <= cap + 1e-9
        assert sorted(r[0] for b in capped for r in b) == list(range(40))  # every request, once
        assert capped[0][0][0] == 0  # the oldest anchors the first batch
    capped = _batches("length", lengths, max_batch_tokens=100_000, max_padding=0.2)
    assert len(capped) <= 8  # still batches: a handful of length groups, not one input at a time
    arrival = _batches("arrival", lengths, max_batch_tokens=100_000, max_padding=0.0)  # the cap is the length policy's
    assert [[r[0] for r in b] for b in arrival] == [list(range(40))]


def test_a_request_wider_than_the_budget_spreads_over_batches_in_order() -> None:
    engine = ScriptedEngine()

    async def main() -> np.ndarray:
        b = Batcher(engine, limits=limits(max_batch_tokens=20, max_wait_ms=0.0))
        b.start()
        try:
            return await b.submit([seq(i, *[1] * i) for i in range(1, 11)])
        finally:
            await b.close()

    out = run(main())
    assert out[:, 0].tolist() == list(range(2, 12))  # lengths, in input order
    assert out[:, 1].tolist() == list(range(1, 11))  # first ids
    assert len(engine.batches) > 1
    assert all(len(b) * max(map(len, b)) <= 20 for b in engine.batches)


def test_an_expired_request_is_dropped_before_inference() -> None:
    engine = ScriptedEngine()

    async def main() -> np.ndarray:
        b = Batcher(engine, limits=limits(max_wait_ms=0.0))
        loop = asyncio.get_running_loop()
        expired = asyncio.ensure_future(b.submit([seq(55)], deadline=loop.time() - 1))
        fine = asyncio.ensure_future(b.submit([seq(56)]))
        await asyncio.sleep(0)
        b.start()
        with pytest.raises(DeadlineExceeded):
            await expired
        try:
            return await fine
        finally:
            assert b.depth == 0
            await b.close()

    assert run(main())[0, 1] == 56
    assert engine.batches == [[[56]]]


def test_queue_limit_and_cancellation_free_slots() -> None:
    async def main() -> None:
        b = Batcher(ScriptedEngine(), limits=limits(max_queue_size=3))  # worker not started: nothing leaves
        first = asyncio.ensure_future(b.submit([seq(1), seq(2)]))
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted) as e:
            await b.submit([seq(3), seq(4)])
        # one slot left: not "full", but no room for two
        assert e.value.message == "the queue has no room for 2 (2 inputs waiting, limit 3); retry later"
        third = asyncio.ensure_future(b.submit([seq(3)]))
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted, match="the queue is full .3 inputs waiting, limit 3."):
            await b.submit([seq(4)])
        third.cancel()
        first.cancel()
        await asyncio.sleep(0)
        assert b.depth == 0
        b.start()
        b.drain()
        assert (await b.submit([seq(3), seq(4), seq(5)])).shape == (3, 4)
        await b.close()

    run(main())


def test_drain_sends_queued_work_without_waiting_for_a_full_batch() -> None:
    async def main() -> np.ndarray:
        b = Batcher(ScriptedEngine(), limits=limits(max_wait_ms=60_000.0))
        b.start()
        b.admit(1)  # a request being tokenised: the queued one waits for it to join its batch
        call = asyncio.ensure_future(b.submit([seq(5, 6)]))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not call.done()  # waiting for the batch to fill, as configured
        b.drain()
        try:
            return await call
        finally:
            await b.close()

    assert run(main())[0, 0] == 2


def test_a_lone_request_starts_at_once_and_one_being_tokenised_is_waited_for() -> None:
    """The start rule, not a timing: with a minute's max wait, what decides is whether anything is on its way."""
    engine = ScriptedEngine()

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_wait_ms=60_000.0))
        b.start()
        # Nothing admitted is being tokenised: the lone request goes to the model at once.
        assert b.should_start()
        first = await asyncio.wait_for(b.submit([seq(5, 6)]), timeout=WAIT)
        assert first.shape == (1, 4)
        # One admitted request is still being tokenised: the queued one waits for it, then both go together.
        ticket = b.admit(1)
        queued = asyncio.ensure_future(b.submit([seq(7)]))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not b.should_start() and not queued.done()
        joined = asyncio.ensure_future(b.submit([seq(8, 8)], ticket=ticket))
        await asyncio.wait_for(asyncio.gather(queued, joined), timeout=WAIT)
        await b.close()

    run(main())
    assert engine.batches == [[[5, 6]], [[7], [8, 8]]]


def test_a_batchs_requests_are_answered_in_the_turn_after_the_thread_hands_it_back() -> None:
    """The return path's turns of the loop, not a timing: the turn in which the inference thread's hand-back
    runs gives the requests their rows, so a request's handler resumes in the very next turn, ahead of
    anything scheduled after the hand-back (before, the batcher's worker resolved them a turn later)."""
    engine = ScriptedEngine()
    order: list[str] = []

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_wait_ms=0.0))
        finish = b._finish

        def marked(*args: Any) -> None:
            finish(*args)
            asyncio.get_running_loop().call_soon(order.append, "the turn after the hand-back ended")

        b._finish = marked  # type: ignore[method-assign,assignment]
        b.start()

        async def handler() -> None:
            await b.submit([seq(5, 6)])
            order.append("the request's handler resumed")

        await asyncio.wait_for(handler(), timeout=WAIT)
        await asyncio.sleep(0)
        await b.close()

    run(main())
    assert order == ["the request's handler resumed", "the turn after the hand-back ended"]


def test_a_batch_whose_answers_cannot_be_handed_out_fails_its_requests_and_the_batcher_goes_on() -> None:
    engine = ScriptedEngine()

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_wait_ms=0.0))
        resolve, calls = b._resolve, []

        def once_broken(*args: Any) -> None:
            calls.append(args)
            if len(calls) == 1:
                raise ValueError("rows of the wrong width")
            resolve(*args)

        b._resolve = once_broken  # type: ignore[method-assign,assignment]
        b.start()
        with pytest.raises(Internal, match="inference failed on the batch holding this request"):
            await asyncio.wait_for(b.submit([seq(5, 6)]), timeout=WAIT)
        assert (await asyncio.wait_for(b.submit([seq(7)]), timeout=WAIT)).shape == (1, 4)
        await b.close()

    run(main())


class Faulty(ScriptedEngine):
    """An engine whose rows holding 13 come out NaN and those holding 14 infinite; a batch holding 15 raises
    SystemExit, one holding 16 RuntimeError, and so does every batch but one holding 90 once `broken` is set
    (an engine that fails whatever it is given)."""

    broken = False

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, *, beside: bool = False) -> np.ndarray:
        out = super().run(input_ids, attention_mask, beside=beside)
        out[(input_ids == 13).any(axis=1), 0] = np.nan
        out[(input_ids == 14).any(axis=1), -1] = np.inf
        if (input_ids == 15).any():
            raise SystemExit(3)
        if (self.broken and not (input_ids == 90).any()) or (input_ids == 16).any():
            raise RuntimeError("the engine failed")
        return out


@pytest.mark.parametrize("token", [13, 14, 15])
def test_nan_inf_or_a_base_exception_from_the_engine_fails_the_batch_and_the_batcher_goes_on(token: int) -> None:
    """NaN went out as an embedding (JSON null in OpenAI's answer); a SystemExit from an engine, set on the
    loop's future, would stop the event loop itself."""
    engine = Faulty()

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_wait_ms=0.0))
        b.start()
        with pytest.raises(Internal, match="inference failed on the batch holding this request"):
            await asyncio.wait_for(b.submit([seq(token, 6)]), timeout=WAIT)
        assert (await asyncio.wait_for(b.submit([seq(7)]), timeout=WAIT)).shape == (1, 4)
        await b.close()

    run(main())


def test_a_failed_batch_asks_for_no_retry() -> None:
    """An input the engine fails on, in a batch of its own, said "...; retry": a retry that cannot succeed
    (and that OpenAI's client makes twice on a 500). Whether the inputs or the engine failed is not known."""
    engine = Faulty()

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_wait_ms=0.0))
        b.start()
        with pytest.raises(Internal) as alone:
            await asyncio.wait_for(b.submit([seq(16, 6)]), timeout=WAIT)
        assert alone.value.message == "inference failed on the batch holding this request (RuntimeError)"
        await b.close()

    run(main())


def test_a_batch_that_gave_way_in_the_turn_the_waiting_are_failed_is_failed_too() -> None:
    """A query's arrival took a batch formed ahead out of the threads' queue (it gave way), and, in the same turn
    of the loop, every thread was found stalled (fail_waiting): the batch's worker, waking after, put its inputs
    back and they waited for the stalled threads, the one request fail_waiting missed (a reviewer's script).
    While every thread stalls (`starved`), what comes is refused too, not queued behind them."""
    engine = ScriptedEngine(gates=[91, 92])

    async def main() -> None:
        stalled: list[str] = []  # the server's word while every thread stalls
        b = Batcher(
            engine, limits=limits(max_batch_tokens=10_000), workers=2, starved=lambda: next(iter(stalled), None)
        )
        b.start()
        held = []

        def computing(n: int) -> Callable[[], bool]:
            return lambda: len(engine.batches) == n

        def formed() -> bool:
            return any(len(batch) == 2 for _, batch in list(b._submitted.values()))

        for n, token in enumerate((91, 92), 1):  # both threads held
            held.append(asyncio.ensure_future(b.submit([seq(token)])))
            await asyncio.to_thread(wait_until, computing(n), "a thread held")
        bulk = asyncio.ensure_future(b.submit([seq(8, 8)] * 2))
        await asyncio.to_thread(wait_until, formed, "the bulk request's batch formed ahead, for a thread")
        query = asyncio.ensure_future(b.submit([seq(5)]))
        await asyncio.sleep(0)  # the query queues, and the bulk request's batch gives way to it
        stalled.append("every inference thread is stalled")
        b.fail_waiting(Unavailable(stalled[0]))
        for request in (query, bulk):
            with pytest.raises(Unavailable):
                await asyncio.wait_for(request, timeout=WAIT)
        with pytest.raises(Unavailable, match="every inference thread is stalled"):
            await b.submit([seq(5)])  # what comes is refused too, not queued behind the stalled threads
        for gate in engine.gates.values():
            gate.set()
        await asyncio.gather(*held)
        stalled.clear()  # a thread is free again
        assert len(await asyncio.wait_for(b.submit([seq(5)]), timeout=WAIT)) == 1
        await b.close()

    run_opening_gates(main(), engine)


async def _held_then(
    b: Batcher, engine: ScriptedEngine, requests: list[list[np.ndarray]], then: Callable[[], None] = lambda: None
) -> list[Any]:
    """`requests` queued while a batch holding 90 computes, so that they form one batch (one worker), then
    `then`, then the held batch released: each request's embeddings or error."""
    held = asyncio.ensure_future(b.submit([seq(90)]))
    await asyncio.to_thread(wait_until, lambda: len(engine.batches) == 1, "the held batch to compute")
    calls = [asyncio.ensure_future(b.submit(r)) for r in requests]
    await asyncio.sleep(0)
    then()
    engine.gates[90].set()
    await held
    return list(await asyncio.gather(*calls, return_exceptions=True))


def test_an_input_the_engine_answers_nan_or_inf_for_fails_its_request_alone() -> None:
    """An encoder's rows are independent: one text that overflows (fp16) failed everyone's batch with it."""
    engine = Faulty(gates=[90])

    async def main() -> list[Any]:
        b = Batcher(engine, limits=limits(max_wait_ms=0.0))
        b.start()
        try:
            return await _held_then(b, engine, [[seq(5, 6)], [seq(13, 6)], [seq(7)], [seq(8), seq(14, 1)], [seq(9)]])
        finally:
            await b.close()

    out = run_opening_gates(main(), engine)
    assert sorted(len(row) for batch in engine.batches[1:] for row in batch) == [1, 1, 1, 2, 2, 2]  # each once
    ok, nan, alone, inf, last = out
    for error, index in ((nan, 0), (inf, 1)):
        assert isinstance(error, Internal)
        assert error.message == f"inference on input {index} of this request was NaN or infinite"
    assert [o.tolist() for o in (ok, alone, last)] == [[[2, 5, 11, 1]], [[1, 7, 7, 1]], [[1, 9, 9, 1]]]


def test_an_input_the_engine_raises_on_fails_its_request_and_the_batch_is_run_again_without_it() -> None:
    engine = Faulty(gates=[90])
    requests = [[seq(5, 6)], [seq(7)], [seq(8, 1)], [seq(16, 2)], [seq(10)], [seq(11, 3)], [seq(9), seq(12, 4)]]

    async def main() -> list[Any]:
        b = Batcher(engine, limits=limits(max_wait_ms=0.0))
        b.start()
        try:
            return await _held_then(b, engine, requests)
        finally:
            await b.close()

    out = run_opening_gates(main(), engine)
    failed = out.pop(3)
    assert (
        isinstance(failed, Internal) and failed.message == "inference on input 0 of this request failed (RuntimeError)"
    )
    assert [o.tolist() for o in out] == [
        [[2, 5, 11, 1]], [[1, 7, 7, 1]], [[2, 8, 9, 1]], [[1, 10, 10, 1]], [[2, 11, 14, 1]],
        [[1, 9, 9, 1], [2, 12, 16, 1]],
    ]  # fmt: skip
    # Each input computed once in a run that returned, and the one that raised in 1 + log2(rows) runs: its
    # batch of 6 (request 6's two inputs took their own turn), then the halves that held it, 3, 2 and 1.
    runs = engine.batches[1:]
    served = sorted(tuple(row) for r in runs if not any(16 in row for row in r) for row in r)
    assert served == sorted(tuple(int(i) for i in x) for r in requests for x in r if 16 not in x)
    assert [len(r) for r in runs if any(16 in row for row in r)] == [6, 3, 2, 1]


def test_an_engine_that_fails_every_batch_fails_it_whole_once_every_input_failed_alone() -> None:
    engine = Faulty(gates=[90])

    def broken() -> None:
        engine.broken = True

    async def main() -> list[Any]:
        b = Batcher(engine, limits=limits(max_wait_ms=0.0))
        b.start()
        try:
            return await _held_then(b, engine, [[seq(k)] for k in range(20, 28)], then=broken)
        finally:
            await b.close()

    out = run_opening_gates(main(), engine)
    assert all(
        isinstance(e, Internal) and e.message.startswith("inference failed on the batch holding this request")
        for e in out
    )
    # The batch, its halves, their halves, and each input alone: 2 x 8 - 1 runs, and no more.
    assert sorted(len(r) for r in engine.batches[1:]) == [1] * 8 + [2] * 4 + [4] * 2 + [8]


def test_the_batchers_lines_carry_no_request_id_of_whoever_started_it(caplog: pytest.LogCaptureFixture) -> None:
    """Its tasks copied the context of their creator: a model loaded by a client's request (explicit model
    control) logged that request's id on every line of its batcher's while it served."""
    engine = Faulty()
    caplog.handler.addFilter(RequestIdFilter())

    async def main() -> None:
        request_id.set("the-loader")
        b = Batcher(engine, limits=limits(max_wait_ms=0.0))
        b.start()
        request_id.set("a-client")
        with pytest.raises(Internal):
            await asyncio.wait_for(b.submit([seq(13, 6)], request_id="a-client"), timeout=WAIT)
        await b.close()

    with caplog.at_level(logging.ERROR, logger="mhaserve.service.batching.batcher"):
        run(main())
    (failed,) = [r for r in caplog.records if r.getMessage().startswith("inference failed on a batch")]
    assert "a-client" in failed.getMessage() and getattr(failed, "request_id", None) == "-"


def test_close_fails_running_and_queued_requests_and_refuses_new_ones() -> None:
    engine = ScriptedEngine(hang_on=99)

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_wait_ms=0.0, max_batch_tokens=2))
        b.start()
        running = asyncio.ensure_future(b.submit([seq(99)]))
        queued = asyncio.ensure_future(b.submit([seq(5, 5)]))
        await asyncio.to_thread(engine.hanging.wait, WAIT)
        await b.close()
        for call in (running, queued):
            with pytest.raises(Unavailable):
                await call
        with pytest.raises(Unavailable):
            await b.submit([seq(1)])

    try:
        run(main())
    finally:
        engine.release.set()


def test_close_stops_a_worker_that_waits_for_its_batch_to_fill() -> None:
    """A request queued while another is tokenised waits for it to join its batch; close() then drains (which
    wakes that wait) and cancels the worker in one turn. On Python 3.11 asyncio.wait_for swallowed that
    cancellation: the worker went on and close() waited for it for ever (found by the random schedules
    below)."""
    engine = ScriptedEngine()

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_wait_ms=60_000.0))
        b.start()
        tokenising = b.admit(1)
        call = asyncio.ensure_future(b.submit([seq(5)]))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not call.done() and not engine.batches  # waiting for the one being tokenised
        closing = asyncio.ensure_future(b.close())
        await asyncio.wait([closing], timeout=WAIT)
        assert closing.done(), "close() never returned"
        with pytest.raises(Unavailable, match="stopped before this request reached the model"):
            await call
        b.release(tokenising)

    run(main())


def test_pad() -> None:
    ids, mask = pad([seq(5, 6, 7), seq(8)], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_two_workers_compute_a_second_batch_while_the_first_is_held() -> None:
    engine = ScriptedEngine(hang_on=99)

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_wait_ms=0.0), workers=2)
        b.start()
        held = asyncio.ensure_future(b.submit([seq(99)]))
        await asyncio.to_thread(engine.hanging.wait, WAIT)
        # One worker is inside the engine: the other takes this request at once.
        assert (await b.submit([seq(5, 5)])).shape == (1, 4)
        assert not held.done()
        engine.release.set()
        assert (await held).shape == (1, 4)
        await b.close()

    try:
        run(main())
    finally:
        engine.release.set()
    assert engine.batches == [[[99]], [[5, 5]]]


class Hooks:
    """A batcher's on_stall and on_recover, their calls recorded in order; `until` waits for a condition on them."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._called = asyncio.Event()

    async def stall(self) -> None:
        self.calls.append("stall")
        self._called.set()

    async def recover(self) -> None:
        self.calls.append("recover")
        self._called.set()

    async def until(self, predicate: Callable[[list[str]], bool]) -> None:
        while not predicate(self.calls):
            await self._called.wait()
            self._called.clear()


def test_with_two_workers_stalled_holds_until_the_last_overrunning_batch_returns() -> None:
    engine = ScriptedEngine(gates=(98, 99))
    hooks = Hooks()

    async def main() -> None:
        b = Batcher(
            engine,
            limits=limits(max_wait_ms=0.0, max_batch_tokens=1),
            workers=2,
            inference_timeout=0.1,
            on_stall=hooks.stall,
            on_recover=hooks.recover,
        )
        b.start()
        calls = [asyncio.ensure_future(b.submit([seq(t)])) for t in (98, 99)]
        await hooks.until(lambda h: h == ["stall", "stall"])
        assert b.stalled
        for call in calls:
            with pytest.raises(Unavailable):
                await call
        engine.gates[98].set()
        await hooks.until(lambda h: h == ["stall", "stall", "recover"])
        assert b.stalled  # the other batch is still inside the engine
        with pytest.raises(Unavailable):
            await b.submit([seq(1)])
        engine.gates[99].set()
        await hooks.until(lambda h: len(h) == 4)
        assert not b.stalled
        assert (await b.submit([seq(1)])).shape == (1, 4)
        await b.close()

    run_opening_gates(main(), engine)


def test_with_two_workers_a_batch_takes_its_share_not_everything_waiting() -> None:
    """One worker holds a batch of 1 while 31 requests arrive: the free worker takes 11 of them (its third of
    the 32 in the batcher: the two workers' batches and the one formed ahead), not all 31, and the batch
    formed ahead 11 more, so that under a closed loop the batches keep even shares of the clients; what they
    leave is taken next, nothing waits for the held batch."""
    engine = ScriptedEngine(hang_on=99)

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_wait_ms=0.0, max_batch_tokens=10_000), workers=2)
        assert b.max_rows() == 1  # an empty batcher: a lone request is a batch of one
        b.start()
        held = asyncio.ensure_future(b.submit([seq(99)]))
        await asyncio.to_thread(engine.hanging.wait, WAIT)
        rest = [asyncio.ensure_future(b.submit([seq(5, 5)])) for _ in range(31)]
        assert all(r.shape == (1, 4) for r in await asyncio.gather(*rest))
        assert not held.done()
        engine.release.set()
        await held
        await b.close()

    try:
        run(main())
    finally:
        engine.release.set()
    sizes = [len(batch) for batch in engine.batches]
    assert sizes[:3] == [1, 11, 11], sizes
    assert sum(sizes[1:]) == 31 and max(sizes[3:]) <= 7, sizes


async def in_engine(engine: ScriptedEngine, n: int) -> None:
    """Until the engine has seen n batches (it records a batch before waiting at its gate)."""
    await asyncio.to_thread(wait_until, lambda: len(engine.batches) == n, f"{n} batches in the engine", WAIT, 0.001)


async def two_workers_one_held(engine: ScriptedEngine) -> tuple[Batcher, asyncio.Future[np.ndarray]]:
    """A batcher with two workers (a minute's max wait) whose first request found nothing computing, went at
    once, and is held at gate 91."""
    b = Batcher(engine, limits=limits(max_wait_ms=60_000.0, max_batch_tokens=10_000), workers=2)
    b.start()
    first = asyncio.ensure_future(b.submit([seq(91)]))
    await in_engine(engine, 1)
    return b, first


def test_a_request_is_told_its_time_in_the_queue_and_in_the_model() -> None:
    """`spent`: queued until the engine began its first input, then in the model until the engine ended its
    last. A request held in the engine 50 ms has 50 ms or more of inference; one queued behind it, 50 ms or
    more of queue; one whose inputs the budget splits into two batches, run one after the other behind a
    held one, the time of both in the model. Each within the time its submit took."""
    engine = ScriptedEngine(gates=[91, 92])
    HELD = 0.05

    async def timed(b: Batcher, seqs: list[np.ndarray]) -> tuple[Spent, float]:
        spent, loop = Spent(), asyncio.get_running_loop()
        started = loop.time()
        await b.submit(seqs, spent=spent)
        return spent, loop.time() - started

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_wait_ms=0.0, max_batch_tokens=2))
        b.start()
        first = asyncio.ensure_future(timed(b, [seq(91, 1)]))
        await in_engine(engine, 1)  # held at its gate
        queued = asyncio.ensure_future(timed(b, [seq(5, 1)]))
        split = asyncio.ensure_future(timed(b, [seq(92, 1), seq(6, 1)]))  # two batches of the budget's 2 tokens
        await asyncio.sleep(HELD)
        engine.gates[91].set()
        await in_engine(engine, 3)  # the queued request's batch ran; the split one's first is held at 92
        await asyncio.sleep(HELD)
        engine.gates[92].set()
        (a, a_wall), (q, q_wall), (s, s_wall) = await asyncio.gather(first, queued, split)
        await b.close()
        assert a.inference >= HELD and q.queue >= HELD and s.inference >= HELD, (a, q, s)
        assert s.queue >= HELD  # behind the held batch too
        for spent, wall in ((a, a_wall), (q, q_wall), (s, s_wall)):
            assert spent.queue >= 0 and spent.inference >= 0
            assert spent.queue + spent.inference <= wall + 0.001, (spent.queue, spent.inference, wall)

    run_opening_gates(main(), engine)
    assert [batch[0][0] for batch in engine.batches] == [91, 5, 92, 6]


def test_with_two_workers_a_batch_formed_ahead_starts_without_the_event_loop() -> None:
    """With two workers, a third batch is formed while both compute; it waits in the threads' queue, and the
    first thread to finish starts it while the event loop is blocked (so not handed over by the loop)."""
    engine = ScriptedEngine(gates=[91, 92])

    async def main() -> None:
        b, first = await two_workers_one_held(engine)
        # 4 inputs wait, 1 computes: a share of 5 over three batches is 2; one batch for the free thread, one ahead.
        second = asyncio.ensure_future(b.submit([seq(92)] * 4))
        await in_engine(engine, 2)
        for _ in range(10):
            await asyncio.sleep(0)
        assert b.depth == 0 and len(engine.batches) == 2  # the third is formed, and no thread is free for it
        engine.gates[91].set()
        wait_until(lambda: len(engine.batches) == 3, "the batch formed ahead to start", WAIT, 0.001)  # loop blocked
        await first
        engine.gates[92].set()
        await second
        await b.close()

    run_opening_gates(main(), engine)
    assert engine.batches == [[[91]], [[92], [92]], [[92], [92]]]


def test_a_batch_is_told_whether_another_computes_or_waits_beside_it() -> None:
    """The engine gives a batch every core only when it computes alone; the batcher tells it (`beside`) when
    another batch computes or inputs wait to start one, since the other worker may be between two runs at
    the instant this one starts. A lone request: alone; one that comes while another computes: beside; the
    first batch of a request whose other inputs wait for the second worker: beside."""
    engine = ScriptedEngine(gates=[91, 92])

    async def main() -> None:
        b, first = await two_workers_one_held(engine)
        second = asyncio.ensure_future(b.submit([seq(92)]))
        await in_engine(engine, 2)
        engine.gates[91].set()
        engine.gates[92].set()
        await asyncio.gather(first, second)
        await b.submit([seq(5)])  # alone again
        await b.submit([seq(6)] * 3)  # a share of 3 over three batches is 1: two inputs wait for the next
        await b.close()

    run_opening_gates(main(), engine)
    assert engine.batches[:4] == [[[91]], [[92]], [[5]], [[6]]]
    assert engine.besides[:4] == [False, True, False, True]


async def bulk_ahead(
    engine: ScriptedEngine,
    batching: str = "length",
    metrics: ModelMetrics | None = None,
    spent: tuple[Spent | None, ...] = (None, None, None),
) -> tuple[Batcher, list[asyncio.Future[Any]]]:
    """Two workers held at gates 91 and 92, and a bulk request of four inputs (8, 8) whose batch of two is
    formed ahead, waiting for a thread; its other two wait in the queue. `spent`: the three requests'."""
    b = Batcher(
        engine,
        limits=limits(max_wait_ms=60_000.0, max_batch_tokens=10_000),
        batching=batching,  # type: ignore[arg-type]
        workers=2,
        metrics=metrics,
    )
    b.start()
    calls: list[asyncio.Future[Any]] = []
    for n, token in enumerate((91, 92), 1):
        calls.append(asyncio.ensure_future(b.submit([seq(token)], spent=spent[n - 1])))
        await in_engine(engine, n)
    calls.append(asyncio.ensure_future(b.submit([seq(8, 8)] * 4, spent=spent[2])))
    for _ in range(10):
        await asyncio.sleep(0)
    assert b.depth == 2 and len(engine.batches) == 2  # a share of 6 over three batches (2) is formed ahead
    return b, calls


@pytest.mark.parametrize("batching", ["length", "arrival"])
def test_a_batch_formed_ahead_of_a_large_requests_inputs_gives_way_to_a_query(batching: str) -> None:
    """Beside an indexing client both threads compute and the batch formed ahead holds its inputs; a query
    that comes then would start only after that batch. With the length policy that batch goes back to the
    queue and the query's batch, formed next, is the one the first free thread starts; the bulk inputs are
    all computed once, and answered in order. Arrival order keeps strict order."""
    engine = ScriptedEngine(gates=[91, 92])

    async def main() -> None:
        b, calls = await bulk_ahead(engine, batching)
        query = asyncio.ensure_future(b.submit([seq(5)]))
        for _ in range(10):
            await asyncio.sleep(0)
        engine.gates[91].set()
        engine.gates[92].set()
        await asyncio.gather(*calls, query)
        assert (await query)[:, 1].tolist() == [5]
        assert calls[2].result()[:, :2].tolist() == [[2, 8]] * 4  # every bulk input's own row
        assert b.depth == 0
        await b.close()

    run_opening_gates(main(), engine)
    assert engine.batches[:2] == [[[91]], [[92]]]
    after = engine.batches[2:]
    assert sorted(row[0] for batch in after for row in batch) == [5, 8, 8, 8, 8]
    if batching == "length":
        assert after[0] == [[5]]
    else:
        assert after[0] == [[8, 8], [8, 8]] and [[5]] in after[1:]


def test_the_queue_wait_histogram_observes_the_queue_time_each_request_is_told() -> None:
    """mhaserve_queue_wait_seconds observes what Spent tells each request of its queue time (x-queue-time,
    ModelStatistics' queue): from its queueing until the engine began its first input. Both threads held, a
    bulk request's batch formed ahead waits for a thread, gives way to a query whose batch then waits in its
    place, and is formed again: the histogram, observed when a batch was formed, missed both waits."""
    metrics = Metrics()
    model = ModelMetrics(metrics, "m", 1)
    engine = ScriptedEngine(gates=[91, 92])
    spent = [Spent() for _ in range(4)]
    HELD = 0.05

    async def main() -> None:
        b, calls = await bulk_ahead(engine, metrics=model, spent=tuple(spent[:3]))
        query = asyncio.ensure_future(b.submit([seq(5)], spent=spent[3]))
        for _ in range(10):
            await asyncio.sleep(0)
        await asyncio.sleep(HELD)  # the bulk request and the query wait behind the held batches
        engine.gates[91].set()
        engine.gates[92].set()
        await asyncio.gather(*calls, query)
        await b.close()

    run_opening_gates(main(), engine)
    assert engine.batches[2] == [[5]]  # the bulk request's batch gave way to the query's
    assert min(s.queue for s in spent[2:]) >= HELD
    samples = from_registry(metrics.registry)
    assert samples.get("mhaserve_queue_wait_seconds_count", model="m") == 4
    told = sum(s.queue for s in spent)
    assert samples.get("mhaserve_queue_wait_seconds_sum", model="m") == pytest.approx(told, rel=1e-9, abs=0)


def test_the_queue_depth_gauge_counts_a_batch_formed_ahead_until_a_thread_begins_it() -> None:
    """mhaserve_queue_depth is the inputs waiting for the model (the HPA scales on it): those of a batch formed
    ahead wait for a thread and count until one begins the batch; given way to a query, they count as queued
    again. They dropped out of it when the batch was formed."""
    metrics = Metrics()
    model = ModelMetrics(metrics, "m", 1)
    engine = ScriptedEngine(gates=[91, 92, 5])

    def depth() -> float:
        return from_registry(metrics.registry).get("mhaserve_queue_depth", model="m")

    async def main() -> None:
        b, calls = await bulk_ahead(engine, metrics=model)
        assert depth() == 4  # two queued, two in the batch formed ahead
        query = asyncio.ensure_future(b.submit([seq(5)]))
        for _ in range(10):
            await asyncio.sleep(0)
        assert depth() == 5  # the bulk inputs back in the queue, the query's batch formed ahead in their place
        engine.gates[91].set()
        await in_engine(engine, 3)  # its thread began the query's batch, held at gate 5
        for _ in range(10):
            await asyncio.sleep(0)
        assert depth() == 4  # the bulk inputs: two formed ahead again, two queued
        engine.gates[92].set()
        engine.gates[5].set()
        await asyncio.gather(*calls, query)
        assert depth() == 0
        await b.close()

    run_opening_gates(main(), engine)


@pytest.mark.parametrize("batching", ["length", "arrival"])
def test_a_request_cancelled_while_its_batch_waits_for_a_thread_is_not_computed(batching: str) -> None:
    """With two workers, a batch formed ahead waits for a thread; its request cancelled (the client gone, its
    deadline passed), the batch was still computed for nobody, where README says such a request never reaches
    the model. It leaves the threads' queue; a request queued behind it (in arrival order, where no batch
    gives way to it) is computed, in the next batch."""
    metrics = Metrics()
    model = ModelMetrics(metrics, "m", 1)
    engine = ScriptedEngine(gates=[91, 92])

    async def main() -> None:
        b, calls = await bulk_ahead(engine, batching, metrics=model)
        other = None
        if batching == "arrival":
            other = asyncio.ensure_future(b.submit([seq(7)]))
            for _ in range(10):
                await asyncio.sleep(0)
        calls[2].cancel()  # the bulk request: two inputs in the batch formed ahead, two queued
        for _ in range(10):
            await asyncio.sleep(0)
        engine.gates[91].set()
        engine.gates[92].set()
        await asyncio.gather(calls[0], calls[1], *([other] if other else []))
        if other is not None:
            assert (await other)[:, 1].tolist() == [7]
        for _ in range(10):
            await asyncio.sleep(0)
        assert b.depth == 0
        assert from_registry(metrics.registry).get("mhaserve_queue_depth", model="m") == 0
        await b.close()

    run_opening_gates(main(), engine)
    assert engine.batches == [[[91]], [[92]]] + ([[[7]]] if batching == "arrival" else [])  # no bulk input


def test_a_batch_that_gave_way_once_keeps_its_place() -> None:
    """The bulk inputs that went back for one query are formed ahead again once the query's batch starts;
    a second query then waits behind them: a stream of queries holds a large request back by at most one
    batch at a time."""
    engine = ScriptedEngine(gates=[91, 92, 5])

    async def main() -> None:
        b, calls = await bulk_ahead(engine)
        first = asyncio.ensure_future(b.submit([seq(5)]))
        for _ in range(10):
            await asyncio.sleep(0)
        engine.gates[91].set()  # its thread takes the query (held at gate 5); the bulk inputs are formed again
        await in_engine(engine, 3)
        for _ in range(10):
            await asyncio.sleep(0)
        second = asyncio.ensure_future(b.submit([seq(6)]))
        for _ in range(10):
            await asyncio.sleep(0)
        engine.gates[5].set()
        engine.gates[92].set()
        await asyncio.gather(*calls, first, second)
        await b.close()

    run_opening_gates(main(), engine)
    assert engine.batches[:3] == [[[91]], [[92]], [[5]]]
    assert engine.batches[3] == [[8, 8], [8, 8]]  # the batch that gave way, before the second query
    assert [[6]] in engine.batches[4:]


def test_a_cancelled_requests_inputs_in_a_batch_that_gives_way_are_dropped() -> None:
    """The bulk client went away while its batch waited for a thread: when the batch gives way to a query,
    its inputs are not queued again, and the queue's count holds only what still waits."""
    engine = ScriptedEngine(gates=[91, 92])

    async def main() -> None:
        b, calls = await bulk_ahead(engine)
        calls[2].cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        assert b.depth == 0  # its two queued inputs gave their slots back; two are in the batch formed ahead
        query = asyncio.ensure_future(b.submit([seq(5)]))
        for _ in range(10):
            await asyncio.sleep(0)
        engine.gates[91].set()
        engine.gates[92].set()
        assert (await query)[:, 1].tolist() == [5]
        await asyncio.gather(*calls[:2])
        assert b.depth == 0
        await b.close()

    run_opening_gates(main(), engine)
    assert engine.batches == [[[91]], [[92]], [[5]]]


def test_queries_among_bulk_requests_with_cancellations_get_their_own_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers, queries arriving among requests of 16 inputs, a tenth of the clients cancelling: batches
    formed ahead give way (counted), and still every request answered holds each of its inputs' own row (the
    scripted engine echoes an input's first id), and nothing is left counted as queued."""
    engine = ScriptedEngine(seconds_per_batch=0.002)
    rng = random.Random(5)
    ids = iter(range(1000, 10**6))

    async def main() -> int:
        b = Batcher(engine, limits=limits(max_wait_ms=1.0, max_batch_tokens=40), workers=2)
        gave_way = 0
        put_back = b._put_back

        def counting(batch: list[Any]) -> None:
            nonlocal gave_way
            gave_way += 1
            put_back(batch)

        monkeypatch.setattr(b, "_put_back", counting)
        b.start()
        calls: list[tuple[list[int], asyncio.Future[np.ndarray]]] = []
        for _ in range(300):
            firsts = [next(ids) for _ in range(rng.choice([1, 1, 1, 16]))]
            call = asyncio.ensure_future(b.submit([seq(f, *[7] * rng.randrange(0, 8)) for f in firsts]))
            calls.append((firsts, call))
            if rng.random() < 0.1:
                asyncio.get_running_loop().call_later(rng.random() * 0.01, call.cancel)
            await asyncio.sleep(rng.random() * 0.001)
        await asyncio.gather(*(call for _, call in calls), return_exceptions=True)
        answered = [(firsts, call.result()) for firsts, call in calls if not call.cancelled()]
        assert len(answered) > 200
        for firsts, rows in answered:
            assert rows[:, 1].tolist() == firsts
        assert b.depth == 0
        await b.close()
        return gave_way

    assert run(main()) > 0


async def three_batches(engine: ScriptedEngine, **kw: Any) -> tuple[Batcher, list[asyncio.Future[np.ndarray]]]:
    """A batcher with two workers (a minute's max wait) and three batches of one input: 91 and 92 in the engine
    (held at their gates, if the engine has them), 93 formed ahead and waiting for a thread."""
    b = Batcher(engine, limits=limits(max_wait_ms=60_000.0, max_batch_tokens=10_000), workers=2, **kw)
    b.start()
    calls: list[asyncio.Future[np.ndarray]] = []
    for n, token in enumerate((91, 92, 93), 1):
        calls.append(asyncio.ensure_future(b.submit([seq(token)])))
        if n < 3:
            await in_engine(engine, n)
    for _ in range(10):
        await asyncio.sleep(0)
    assert b.depth == 0 and len(engine.batches) == 2  # the third is formed, and no thread is free for it
    return b, calls


def test_the_inference_timeout_bounds_a_batch_from_when_its_thread_starts_it() -> None:
    """A batch formed ahead waits for a thread; --inference-timeout bounds its computing, not that wait: here
    it waits 0.6 s and computes 0.6 s under a bound of 1 s, and is answered."""
    engine = ScriptedEngine(gates=[91, 92, 93])
    hooks = Hooks()

    async def main() -> None:
        b, calls = await three_batches(engine, inference_timeout=1.0, on_stall=hooks.stall)
        await asyncio.sleep(0.6)
        engine.gates[91].set()
        engine.gates[92].set()
        await in_engine(engine, 3)
        await asyncio.sleep(0.6)  # 1.2 s since it was formed
        engine.gates[93].set()
        assert [out.shape for out in await asyncio.gather(*calls)] == [(1, 4)] * 3
        assert hooks.calls == [] and not b.stalled
        await b.close()

    run_opening_gates(main(), engine)


def test_a_stall_fails_its_batch_as_timed_out_and_the_queue_as_unavailable(caplog: pytest.LogCaptureFixture) -> None:
    """The batch past --inference-timeout ran too long (HTTP 504); the requests queued behind it never ran and
    are failed as new ones are refused while it stalls (UNAVAILABLE, HTTP 503: retry on another replica). The log
    names them too, as it names the batch's (it named only those: a review's finding)."""
    engine = ScriptedEngine(gates=[91])

    async def main() -> None:
        b = Batcher(engine, limits=limits(max_wait_ms=0.0, max_batch_tokens=1), inference_timeout=0.2)
        b.start()
        held = asyncio.ensure_future(b.submit([seq(91)], request_id="r-held"))
        await in_engine(engine, 1)
        queued = [asyncio.ensure_future(b.submit([seq(t)], request_id=f"r-{t}")) for t in (1, 2)]
        with pytest.raises(InferenceTimeout):
            await held
        for call in queued:
            with pytest.raises(Unavailable, match="inference-timeout") as failed:
                await call
            assert not isinstance(failed.value, InferenceTimeout)
        engine.gates[91].set()
        await b.close()

    with caplog.at_level(logging.WARNING, logger="mhaserve.service.batching.batcher"):
        run_opening_gates(main(), engine)
    assert engine.batches == [[[91]]]
    said = [r.getMessage() for r in caplog.records if r.name == "mhaserve.service.batching.batcher"]
    assert said == ["the stall refused 2 request(s) that had not run (UNAVAILABLE): r-1, r-2"]


def test_a_stall_fails_the_batch_waiting_for_a_thread_which_never_runs() -> None:
    """Both threads overrun: the batch formed ahead fails with them (like the queue), without a stall of its own,
    and is taken out of the threads' queue, so that the threads, once they return, do not compute it for nobody."""
    engine = ScriptedEngine(gates=[91, 92, 93])
    hooks = Hooks()
    metrics = Metrics()

    async def main() -> None:
        b, calls = await three_batches(
            engine,
            inference_timeout=0.2,
            on_stall=hooks.stall,
            on_recover=hooks.recover,
            metrics=ModelMetrics(metrics, "m", 1),
        )
        for call in calls[:2]:
            with pytest.raises(InferenceTimeout, match="inference-timeout"):  # HTTP 504: they ran too long
                await call
        with pytest.raises(Unavailable, match="inference-timeout") as never_ran:
            await calls[2]
        assert not isinstance(never_ran.value, InferenceTimeout)  # HTTP 503: it never ran, retry elsewhere
        assert from_registry(metrics.registry).get("mhaserve_queue_depth") == 0  # nor waits for it any more
        await hooks.until(lambda h: len(h) == 2)
        engine.gates[91].set()
        engine.gates[92].set()
        await hooks.until(lambda h: h.count("recover") == 2)
        assert hooks.calls == ["stall", "stall", "recover", "recover"] and not b.stalled
        engine.gates[93].set()
        assert (await b.submit([seq(1)])).shape == (1, 4)
        await b.close()

    run_opening_gates(main(), engine)
    assert engine.batches == [[[91]], [[92]], [[1]]]


def test_a_stalled_batch_of_a_closed_batcher_still_recovers_when_its_engine_returns() -> None:
    """A version retired while its batch stalled (unloaded, or replaced by a newer one): close() cancelled the
    worker waiting for the engine, and with it the recovery, so the server, told of the stall but never of the
    return, reported NOT_SERVING and refused every request for good."""
    engine = ScriptedEngine(gates=[91])
    hooks = Hooks()

    async def main() -> None:
        b = Batcher(
            engine,
            limits=limits(max_wait_ms=0.0),
            inference_timeout=0.1,
            on_stall=hooks.stall,
            on_recover=hooks.recover,
        )
        b.start()
        with pytest.raises(InferenceTimeout):
            await b.submit([seq(91)])
        await hooks.until(lambda h: h == ["stall"])
        await b.close()  # the engine still holds the batch
        engine.gates[91].set()
        await hooks.until(lambda h: h == ["stall", "recover"])
        assert not b.stalled

    run_opening_gates(main(), engine)


def test_with_two_workers_a_batch_beside_another_waits_for_its_share() -> None:
    """The start rule with several workers, not a timing (a minute's max wait). While other batches compute,
    a request waits until the queue holds its share of the inputs (max_rows, over the two workers' batches
    and the one formed ahead), as the other requests of a batch just answered come back, and then they go
    together; when nothing computes any more it goes at once. A request that finds nothing computing goes
    at once, as ever."""
    engine = ScriptedEngine(gates=[91, 92])

    async def main() -> None:
        b, first = await two_workers_one_held(engine)
        held = asyncio.ensure_future(b.submit([seq(92)] * 4))  # two batches of its share of 5 (2), at once
        engine.gates[91].set()
        await first
        await in_engine(engine, 3)
        # Four inputs compute; one waiting is less than its share (2 of 5): it waits for another.
        alone = asyncio.ensure_future(b.submit([seq(5)]))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not b.should_start() and not alone.done() and b.depth == 1
        pair = asyncio.ensure_future(b.submit([seq(6)]))
        for _ in range(10):
            await asyncio.sleep(0)
        assert b.depth == 0  # together, in the batch formed ahead
        engine.gates[92].set()
        await asyncio.gather(held, alone, pair)
        # Nothing computes any more: a lone request goes at once.
        await b.submit([seq(7)])
        await b.close()

    run_opening_gates(main(), engine)
    assert engine.batches == [[[91]], [[92], [92]], [[92], [92]], [[5], [6]], [[7]]]


def test_one_worker_takes_everything_the_budget_allows() -> None:
    assert Batcher(ScriptedEngine(), limits=limits()).max_rows() is None


@pytest.mark.parametrize("batching", ["length", "arrival"])
def test_a_policy_stops_at_max_rows_and_keeps_the_oldest(batching: str) -> None:
    from mhaserve.service.batching.policies import make_policy
    from mhaserve.service.batching.queue import Job, Seq

    async def main() -> list[list[int]]:
        policy = make_policy(batching, 1.0)  # type: ignore[arg-type]
        job = Job(asyncio.get_running_loop().create_future(), 10, None, "")
        policy.push([Seq(job, i, seq(*[i] * (3 + i % 2)), i) for i in range(10)])
        taken = [policy.take(10_000, lambda s: not s.taken, max_rows=4) for _ in range(3)]
        return [[int(s.ids[0]) for s in batch] for batch in taken]

    batches = run(main())
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [b[0] for b in batches] == ([0, 1, 8] if batching == "length" else [0, 4, 8])  # the oldest leads each
    assert sorted(i for b in batches for i in b) == list(range(10))


def test_a_batch_is_handed_back_once_and_its_metrics_are_observed_on_the_loop() -> None:
    """The inference thread settles the batch through one call onto the loop and does nothing after it
    (the loop then finds the GIL free); the batch's histograms are observed on the loop's thread."""
    metrics = Metrics()
    model = ModelMetrics(metrics, "m", 1)
    engine = ScriptedEngine()
    observed_on: list[str] = []
    observe = model.batch_size.observe

    def recording(value: float, exemplar: dict[str, str] | None = None) -> None:
        observed_on.append(threading.current_thread().name)
        observe(value, exemplar)

    model.batch_size.observe = recording  # type: ignore[method-assign,assignment]

    async def scenario() -> list[np.ndarray]:
        loop = asyncio.get_running_loop()
        handed: list[str] = []
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(callback: Callable[..., Any], *args: Any) -> Any:
            handed.append(threading.current_thread().name)
            return call_soon_threadsafe(callback, *args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]
        b = Batcher(engine, limits=limits(max_wait_ms=0.0), metrics=model)
        b.start()
        try:
            out = await asyncio.gather(b.submit([seq(5, 6, 7)]), b.submit([seq(8, 9)]))
            await asyncio.sleep(0)  # the metrics' turn, after the requests'
        finally:
            await b.close()
        assert len(handed) == len(engine.batches) and all(n.startswith("inference") for n in handed)
        return list(out)

    out = run(scenario())
    assert [o.shape for o in out] == [(1, 4), (1, 4)]
    samples = from_registry(metrics.registry)
    rows = sum(len(batch) for batch in engine.batches)
    assert samples.get("mhaserve_batch_size_sum", model="m") == rows == 2
    assert samples.get("mhaserve_batch_size_count", model="m") == len(engine.batches)
    assert samples.get("mhaserve_inference_duration_seconds_count", model="m") == len(engine.batches)
    assert samples.get("mhaserve_batch_tokens_count", model="m") == len(engine.batches)
    assert observed_on == ["MainThread"] * len(engine.batches)


# ---- random schedules: whatever happens, every request is answered once, with its own rows ------------------


class Poisoned(ScriptedEngine):
    """Rows holding 13 come out NaN; a batch holding 16 raises (the batcher splits it to find the input)."""

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, *, beside: bool = False) -> np.ndarray:
        out = super().run(input_ids, attention_mask, beside=beside)
        out[(input_ids == 13).any(axis=1), 0] = np.nan
        if (input_ids == 16).any():
            raise RuntimeError("the engine failed")
        return out


# Examples a run: 150 in the suite (a few seconds); more by hand, BATCHER_EXAMPLES=3000 (about two minutes).
EXAMPLES = int(os.environ.get("BATCHER_EXAMPLES", "150"))
# A schedule's requests end within milliseconds; one that hangs is found after this many seconds.
SCHEDULE_WAIT = float(os.environ.get("BATCHER_SCHEDULE_WAIT", "10"))

# One request: its inputs' lengths, a poison token in one of them (None, 13 or 16), a deadline in ms (None for
# none), a cancel after so many ms (None for none), and whether it is admitted first and tokenised for a
# while (the servers' path) or submitted at once; then a pause in ms before the next request.
_requests = st.tuples(
    st.lists(st.integers(1, 12), min_size=1, max_size=6),
    st.sampled_from([None, None, None, 13, 16]),
    st.sampled_from([None, None, None, 0.0, 0.5, 3.0]),
    st.sampled_from([None, None, None, None, 0.0, 0.3, 2.0]),
    st.booleans(),
    st.sampled_from([0.0, 0.0, 0.2, 1.0]),
)


@given(
    schedule=st.lists(_requests, min_size=1, max_size=25),
    workers=st.sampled_from([1, 2, 3]),
    engine_ms=st.sampled_from([0.0, 0.3, 2.0]),
    batching=st.sampled_from(["length", "arrival"]),
    budget=st.sampled_from([6, 24, 400]),
    max_padding=st.sampled_from([1.0, 0.2]),
    max_wait_ms=st.sampled_from([0.0, 1.0]),
    queue=st.sampled_from([8, 1000]),
    close_after=st.one_of(st.none(), st.integers(0, 25)),
)
@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_any_schedule_answers_every_request_once_with_its_own_rows(
    schedule: list[tuple[list[int], int | None, float | None, float | None, bool, float]],
    workers: int,
    engine_ms: float,
    batching: str,
    budget: int,
    max_padding: float,
    max_wait_ms: float,
    queue: int,
    close_after: int | None,
) -> None:
    """Requests of several inputs, some with a poisoned input (NaN, or a batch that raises), deadlines,
    cancellations, a tokenising wait, a small queue, one to three workers, batches that take no time to 2 ms,
    either policy, the server closing midway: every request ends (nothing hangs), refused at once, or failed
    for a reason it had (its own poisoned input, its deadline, its cancellation, the close), or answered with
    each of its inputs' own rows; the others in a poisoned batch are served; no batch passes its budget or,
    with the length policy, its padding cap; nothing is left counted as waiting, the gauge included; and
    the queue wait is observed once for each request whose inputs reached the engine."""
    engine = Poisoned(seconds_per_batch=engine_ms / 1000)
    ids = iter(range(1000, 10**6))
    metrics = Metrics()
    calls: list[tuple[list[int], int | None, float | None, float | None, bool, asyncio.Task[np.ndarray]]] = []

    async def main() -> None:
        b = Batcher(
            engine,
            limits=limits(
                max_batch_tokens=budget, max_wait_ms=max_wait_ms, max_queue_size=queue, max_padding=max_padding
            ),
            batching=batching,  # type: ignore[arg-type]
            workers=workers,
            metrics=ModelMetrics(metrics, "m", 1),
        )
        put_back = b._put_back

        def counted(batch: list[Any]) -> None:
            event("a batch formed ahead gave way")
            put_back(batch)

        b._put_back = counted  # type: ignore[method-assign]
        # The cap is the length policy's, on the batch it takes. What the engine gets can be less padded or
        # more: a batch's inputs whose request failed meanwhile (a deadline found passed while the batch was
        # taken) are dropped, and a batch that raised runs again in halves.
        take, over_cap = b._policy.take, list[list[int]]()

        def capped(tokens: int, live: Live, max_rows: int | None = None) -> list[Seq]:
            batch = take(tokens, live, max_rows)
            lengths = [s.length for s in batch]
            if batching == "length" and len(batch) > 1 and 1 - sum(lengths) / (len(batch) * max(lengths)) > max_padding:
                over_cap.append(lengths)
            return batch

        b._policy.take = capped  # type: ignore[method-assign,assignment]
        b.start()
        loop = asyncio.get_running_loop()

        async def request(inputs: list[np.ndarray], deadline_ms: float | None, admitted: bool) -> np.ndarray:
            deadline = None if deadline_ms is None else loop.time() + deadline_ms / 1000
            if not admitted:
                return await b.submit(inputs, deadline=deadline)
            ticket = b.admit(len(inputs))
            try:
                await asyncio.sleep(0.0002)  # tokenising
                return await b.submit(inputs, deadline=deadline, ticket=ticket)
            finally:
                b.release(ticket)  # what a failed or cancelled request's ticket still holds

        async def close() -> None:
            closing = asyncio.ensure_future(b.close())
            await asyncio.wait([closing], timeout=SCHEDULE_WAIT)
            assert closing.done(), "close() never returned"

        closed = False
        for n, (lengths, poison, deadline_ms, cancel_ms, admitted, pause_ms) in enumerate(schedule):
            if n == close_after:
                await close()
                closed = True
            firsts = [next(ids) for _ in lengths]
            inputs = [seq(f, *[7] * (length - 1)) for f, length in zip(firsts, lengths, strict=True)]
            if poison is not None:
                inputs[-1] = seq(firsts[-1], poison, *[7] * (lengths[-1] - 1))
            task = asyncio.ensure_future(request(inputs, deadline_ms, admitted))
            if cancel_ms is not None:
                loop.call_later(cancel_ms / 1000, task.cancel)
            calls.append((firsts, poison, deadline_ms, cancel_ms, closed, task))
            if pause_ms:
                await asyncio.sleep(pause_ms / 1000)
        _, pending = await asyncio.wait([c[-1] for c in calls], timeout=SCHEDULE_WAIT)
        assert not pending, f"{len(pending)} requests never answered"
        if not closed:
            await close()

        served: set[int] = set()
        for firsts, poison, deadline_ms, cancel_ms, after_close, task in calls:
            if task.cancelled():
                assert cancel_ms is not None, "a request nobody cancelled was cancelled"
                continue
            error = task.exception()
            if error is None:
                rows = task.result()
                assert poison is None, "a poisoned input was served"
                assert rows[:, 1].tolist() == firsts, "a request got rows that are not its inputs'"
                assert deadline_ms != 0.0, "served after its deadline"
                served.update(firsts)
                continue
            if isinstance(error, ResourceExhausted):
                assert queue < 1000, f"refused with room in the queue: {error}"
            elif isinstance(error, DeadlineExceeded):
                assert deadline_ms is not None, "a request without a deadline failed on one"
            elif isinstance(error, Internal):
                assert poison is not None, f"a request with no poisoned input failed: {error}"
            elif isinstance(error, Unavailable):
                assert close_after is not None, f"unavailable with no close: {error}"
            else:
                raise AssertionError(f"unexpected {type(error).__name__}: {error}")
            assert not after_close or isinstance(error, Unavailable) or cancel_ms is not None
        for batch in engine.batches:
            if len(batch) > 1:
                assert len(batch) * max(map(len, batch)) <= budget, "a batch passed its token budget"
        assert not over_cap, f"batches taken past the padding cap: {over_cap}"
        computed = {row[0] for batch in engine.batches for row in batch}
        assert served <= computed
        assert b.depth == 0 and b._tokens == 0 and b._computing == 0, "inputs left counted as waiting"

    run(main())

    def settled() -> bool:  # a thread the close left running may be between beginning a batch and computing it
        samples = from_registry(metrics.registry)
        computed = {row[0] for batch in engine.batches for row in batch}
        reached = sum(1 for firsts, *_ in calls if computed & set(firsts))
        return samples.get("mhaserve_queue_depth") == 0 and samples.get("mhaserve_queue_wait_seconds_count") == reached

    wait_until(settled, "no input counted as waiting, and the queue wait observed once for each request computed")
