"""The in-process replay of the server's batches (bench/inprocess.py `served_batches`): the batches the
length policy forms for a closed loop of clients, checked against what such a loop can and cannot do; and
timed passes with several callers side by side."""

from __future__ import annotations

import random
import threading
import time

import pytest

from mhaserve.loadtest.bench.beside import schedule
from mhaserve.loadtest.bench.inprocess import replay, served_batches, timed_passes
from mhaserve.loadtest.bench.options import served_batching
from mhaserve.loadtest.bench.workloads import Workload


def _workload(n: int = 300, seed: int = 1) -> Workload:
    rng = random.Random(seed)
    # Lengths like the short-text corpus's: mostly queries, a tail of paragraphs.
    lengths = [rng.randint(4, 30) if rng.random() < 0.85 else rng.randint(60, 256) for _ in range(n)]
    return Workload("short", "test", "ids", [[101] + [7] * (k - 2) + [102] for k in lengths])


def _padding(w: Workload, batch: list[int]) -> float:
    lengths = [len(w.ids[i]) for i in batch]
    return 1 - sum(lengths) / (max(lengths) * len(lengths))


@pytest.mark.parametrize("clients", [1, 2, 8, 32])
@pytest.mark.parametrize("max_padding", [0.0, 0.1, 0.3])
def test_every_input_once_within_the_limits_and_the_clients(clients: int, max_padding: float) -> None:
    w = _workload()
    plan = served_batches(w, clients, max_padding=max_padding, budget=2048)
    assert sorted(i for batch in plan for i in batch) == list(range(len(w.ids)))
    for batch in plan:
        # Each client has one input waiting at most, and the batch computing holds some of them.
        assert 1 <= len(batch) <= clients
        assert _padding(w, batch) <= max_padding + 1e-9
        assert max(len(w.ids[i]) for i in batch) * len(batch) <= 2048


def test_one_client_is_one_input_per_batch_and_more_clients_make_wider_batches() -> None:
    w = _workload()
    assert all(len(b) == 1 for b in served_batches(w, 1, max_padding=0.1, budget=8192))
    means = [len(w.ids) / len(served_batches(w, c, max_padding=0.1, budget=8192)) for c in (2, 8, 32)]
    assert means == sorted(means) and means[-1] > 2, means
    # A larger cap trades padding for width.
    wider = served_batches(w, 32, max_padding=0.3, budget=8192)
    assert len(wider) < len(served_batches(w, 32, max_padding=0.1, budget=8192))


def test_the_clients_of_the_batch_computing_send_again_only_once_it_ends() -> None:
    # Two clients, equal lengths, no cap in the way. The first input starts alone (nothing else waits);
    # the second arrives while it computes and is the next batch, alone again, because the first client
    # sends again only once answered: with one worker the two clients take turns, one input per batch.
    w = Workload("fixed", "test", "ids", [[1] * 8 for _ in range(40)])
    assert [len(b) for b in served_batches(w, 2, max_padding=1.0, budget=8192)] == [1] * 40
    # Eight clients: after the first lone input, seven wait, then the one answered comes back, and so on.
    sizes = [len(b) for b in served_batches(w, 8, max_padding=1.0, budget=8192)]
    assert sizes[:4] == [1, 7, 1, 7], sizes


def test_the_limits_it_replays_are_the_ones_the_server_was_given() -> None:
    assert served_batching((1, 8, 32, 64), [], 32, env={}) == {
        "clients": 32,
        "max_padding": None,
        "max_batch_tokens": None,
    }
    assert served_batching((1, 4), [], 32, env={})["clients"] == 4  # the nearest measured
    flags = ["--max-padding=0.2", "--max-batch-tokens=1024"]
    assert served_batching((32,), flags, 32, env={"MHASERVE_MAX_PADDING": "0.5"}) == {
        "clients": 32,
        "max_padding": 0.2,
        "max_batch_tokens": 1024,
    }
    assert served_batching((32,), [], 32, env={"MHASERVE_MAX_PADDING": "0"})["max_padding"] == 0.0
    with pytest.raises(ValueError, match="not a number"):
        served_batching((32,), ["--max-padding=abc"], 32, env={})


@pytest.mark.parametrize("callers", [1, 2, 3])
def test_timed_passes_run_every_batch_once_a_pass_with_that_many_callers_at_once(callers: int) -> None:
    plan = [[i, i + 100] for i in range(12)]
    seen: list[int] = []
    running, most = 0, 0
    lock = threading.Lock()

    def run(batch: list[int]) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
            seen.append(batch[0])
        time.sleep(0.02)  # long enough for the other callers to start theirs
        with lock:
            running -= 1
        return 2 * len(batch)

    timing = timed_passes(run, plan, min_time=0.0, callers=callers)
    assert timing["passes"] == 1 and timing["sequences"] == 24 and timing["padded_tokens"] == 48
    assert len(timing["latencies"]) == 12
    assert sorted(seen[1:]) == list(range(12)) and seen[0] == 0  # the untimed warm-up call, then the pass
    assert most == callers


class FakeClock:
    """A clock that only sleeps and runs move."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.now += seconds


def test_replay_times_each_query_from_when_it_was_due_and_a_late_start_counts() -> None:
    clock, ran = FakeClock(), []

    def run(idx: list[int]) -> int:
        ran.append((clock.now, idx))
        clock.now += 0.010  # each run takes 10 ms
        return 1

    # Due at 0, 5 ms (while the first still runs: starts 5 ms late), 50 ms (on time).
    got = replay(run, [(0.0, 3), (0.005, 7), (0.050, 3)], clock=clock, sleep=clock.sleep)
    assert got == pytest.approx([10.0, 15.0, 10.0])
    assert [idx for _, idx in ran] == [[3], [7], [3]]
    assert [t - 100.0 for t, _ in ran] == pytest.approx([0.0, 0.010, 0.050])


def test_the_replay_is_sent_the_queries_the_server_was_sent() -> None:
    queries = schedule(2000, 12.0, 10.0, seed=7)
    assert queries == schedule(2000, 12.0, 10.0, seed=7) != schedule(2000, 12.0, 10.0, seed=8)
    due = [t for t, _ in queries]
    assert due == sorted(due) and due[0] > 0 and due[-1] < 12.0
    assert 60 < len(queries) < 180  # about 10 a second for 12 s
    assert all(0 <= i < 2000 for _, i in queries)
