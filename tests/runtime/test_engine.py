"""OnnxEngine's overlap session: a batch that starts while another computes (in this process or, through a
table in shared memory, in another) runs on it, with the same result; a batch alone, and every batch of an
engine without one, runs on the main session."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mhaserve.runtime import devices
from mhaserve.runtime.devices import CPU, cuda_loads, wants_cuda
from mhaserve.runtime.engine import OnnxEngine, Runs, release_memory, warm_up
from mhaserve.runtime.errors import Unavailable
from mhaserve.runtime.repository import ModelRepository, auto_graph, onnx_engine
from mhaserve.testing.loopback import WAIT


class Held:
    """A session whose next run waits until released: a batch held computing, deterministically."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.entered = threading.Event()
        self.release = threading.Event()
        self.runs = 0

    def run(self, *args: Any) -> Any:
        self.runs += 1
        self.entered.set()
        assert self.release.wait(WAIT)
        return self.session.run(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


@contextlib.contextmanager
def computing(eng: OnnxEngine) -> Iterator[Held]:
    """A batch held computing on `eng`'s main session for the body of the `with`."""
    held = Held(eng.session)
    eng.session = held
    thread = threading.Thread(target=eng.run, args=batch(3, 12, seed=1))
    thread.start()
    try:
        assert held.entered.wait(WAIT)
        yield held
    finally:
        held.release.set()
        thread.join(WAIT)
        eng.session = held.session


def batch(rows: int, width: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(seed).integers(5, 200, size=(rows, width), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[0, width // 2 :] = 0  # one padded row: the overlap session must mask as the main one does
    return ids, mask


def engine(entry: Path, overlap_threads: int | None) -> OnnxEngine:
    return OnnxEngine(
        entry / "model.onnx", max_seq_len=160, vocab_size=256, device="cpu", intra_op_threads=2,
        overlap_threads=overlap_threads,
    )  # fmt: skip


def test_a_batch_that_starts_while_another_computes_runs_on_the_overlap_session(tiny_entry: Path) -> None:
    eng = engine(tiny_entry, overlap_threads=1)
    assert eng.overlap_session is not None
    first, second = batch(3, 12, seed=1), batch(2, 9, seed=2)
    alone = eng.run(*second)  # nothing else computing: the main session
    assert eng.overlapped_runs == 0

    held = Held(eng.session)
    eng.session = held
    results: dict[str, np.ndarray] = {}
    computing = threading.Thread(target=lambda: results.update(first=eng.run(*first)))
    computing.start()
    assert held.entered.wait(WAIT)
    results["second"] = eng.run(*second)  # starts while the first computes
    assert eng.overlapped_runs == 1 and held.runs == 1
    held.release.set()
    computing.join(WAIT)

    np.testing.assert_allclose(results["second"], alone, rtol=1e-5, atol=1e-6)
    assert results["first"].shape == (3, alone.shape[1])
    eng.session = held.session
    eng.run(*second)  # alone again: back on the main session
    assert eng.overlapped_runs == 1


def test_a_batch_run_beside_another_takes_the_overlap_session_when_none_is_counted(tiny_entry: Path) -> None:
    """`beside` (the batcher knows of another batch, which may be between runs this instant): the overlap
    session, with its share of the cores, though no other run is in progress; without it, the main one."""
    eng = engine(tiny_entry, overlap_threads=1)
    ids, mask = batch(2, 9, seed=4)
    alone = eng.run(ids, mask)
    assert eng.overlapped_runs == 0
    beside = eng.run(ids, mask, beside=True)
    assert eng.overlapped_runs == 1
    np.testing.assert_allclose(beside, alone, rtol=1e-5, atol=1e-6)
    without = engine(tiny_entry, overlap_threads=None)
    without.run(ids, mask, beside=True)  # nothing to take: the main session
    assert without.overlapped_runs == 0


def test_without_an_overlap_session_every_batch_runs_on_the_main_one(tiny_entry: Path) -> None:
    eng = engine(tiny_entry, overlap_threads=None)
    assert eng.overlap_session is None
    held = Held(eng.session)
    eng.session = held
    held.release.set()
    eng.run(*batch(2, 8, seed=3))
    assert held.runs == 1 and eng.overlapped_runs == 0


def test_releasing_the_shared_arena_leaves_other_engines_on_it_answering_alike(tiny_entry: Path) -> None:
    """An unloaded engine's shared arena is shrunk by a run on each of its sessions (docs/models.md has the
    memory it gives back); an engine beside it on the same arena answers as before, and an engine with
    no shared arena (one session) runs nothing."""
    leaving, staying = engine(tiny_entry, overlap_threads=1), engine(tiny_entry, overlap_threads=1)
    ids, mask = batch(4, 40, seed=5)
    before = staying.run(ids, mask)
    sessions = [Held(leaving.session), Held(leaving.overlap_session)]
    for held in sessions:
        held.release.set()
    leaving.session, leaving.overlap_session = sessions
    release_memory(leaving)
    assert [held.runs for held in sessions] == [1, 1]
    np.testing.assert_array_equal(staying.run(ids, mask), before)
    alone = engine(tiny_entry, overlap_threads=None)
    held = Held(alone.session)
    alone.session = held
    release_memory(alone)
    assert held.runs == 0


@pytest.mark.parametrize("overlap_threads", [None, 1])
def test_warm_up_plans_both_sessions(tiny_entry: Path, overlap_threads: int | None) -> None:
    eng = engine(tiny_entry, overlap_threads=overlap_threads)
    sessions = [Held(eng.session)] + ([Held(eng.overlap_session)] if eng.overlap_session is not None else [])
    for held in sessions:
        held.release.set()
    eng.session = sessions[0]
    if overlap_threads:
        eng.overlap_session = sessions[1]
    runs = warm_up(eng, max_seq_len=160, max_batch_tokens=640)
    shapes = len([1, 2, 4, 8, 16, 32, 64, 128, 160]) + 1  # one row per length, then the widest batch
    # the main session runs the vocabulary's last id first (test_warm_up_refuses_a_vocabulary_the_graph_has_not)
    assert [held.runs for held in sessions] == [shapes + 1] + [shapes] * (len(sessions) - 1)
    assert runs == shapes * len(sessions) + 1


def test_warm_up_refuses_a_vocabulary_the_graph_has_not(tiny_entry: Path, tmp_path: Path) -> None:
    """A manifest whose vocab_size is past the graph's embedding table (edited by hand, or beside another graph)
    let ids between the two through the vocabulary check to the graph: each such request failed 500 while the
    version was reported READY. The warm-up now runs the last id, and the load fails saying why."""
    copy = tmp_path / "m" / "1"
    shutil.copytree(tiny_entry, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["vocab_size"] = 100_000  # the tiny graph's table has 256 rows
    (copy / "manifest.json").write_text(json.dumps(m))
    eng = OnnxEngine(copy / "model.onnx", max_seq_len=160, vocab_size=100_000, device="cpu")
    with pytest.raises(Unavailable, match=r"token id 99999, the last of the vocab_size 100000 its manifest says"):
        warm_up(eng, max_seq_len=160, max_batch_tokens=640)
    warm_up(engine(tiny_entry, overlap_threads=None), max_seq_len=160, max_batch_tokens=640)  # 256: every id runs


def test_a_token_budget_whose_widest_batch_cannot_run_fails_the_load_naming_the_budget(tiny_entry: Path) -> None:
    """`--max-batch-tokens 1e12` failed the load with "Unable to allocate 7.28 TiB for an array ..." (numpy's) or
    an ONNX Runtime arena failure, naming neither the budget nor where it is set."""
    budget = 10**13  # 62.5 billion inputs of 160 tokens: no machine allocates that
    with pytest.raises(Unavailable) as e:
        warm_up(engine(tiny_entry, overlap_threads=None), max_seq_len=160, max_batch_tokens=budget)
    assert str(e.value).startswith(
        f"the widest batch of the token budget, {budget // 160} inputs of 160 tokens (max_batch_tokens {budget}: "
        "--max-batch-tokens, or limits in the model's serving.json), cannot run here: "
    )


def test_the_two_sessions_share_one_arena_and_a_lone_session_keeps_its_own(tiny_entry: Path) -> None:
    """Each session's own arena would plan for the widest batch twice (MiniLM: 946 MB resident after warm-up,
    626 MB shared, 540 MB with one session)."""

    def shared(session: Any) -> bool:
        try:
            return bool(session.get_session_options().get_session_config_entry("session.use_env_allocators") == "1")
        except RuntimeError:  # not set: the session's own arena
            return False

    two = engine(tiny_entry, overlap_threads=1)
    assert shared(two.session) and shared(two.overlap_session)
    assert not shared(engine(tiny_entry, overlap_threads=None).session)


def test_engines_of_one_factory_count_each_others_runs(tiny_entry: Path) -> None:
    """Two models served together: a batch of one that starts while the other's computes takes the overlap
    session, as beside a batch of its own (every core for both would preempt each other); engines made
    apart do not see each other."""
    repo = ModelRepository(tiny_entry.parent.parent)
    make = onnx_engine("cpu", intra_op_threads=None, overlap_threads=1)
    a, b = make(repo.entry("tiny")), make(repo.entry("tiny"))
    apart = onnx_engine("cpu", intra_op_threads=None, overlap_threads=1)(repo.entry("tiny"))
    assert isinstance(a, OnnxEngine) and isinstance(b, OnnxEngine) and isinstance(apart, OnnxEngine)
    with computing(a):
        b.run(*batch(2, 9, seed=2))  # starts while a's batch computes
        apart.run(*batch(2, 9, seed=2))
    assert (a.overlapped_runs, b.overlapped_runs, apart.overlapped_runs) == (0, 1, 0)
    b.run(*batch(2, 9, seed=2))  # alone now
    assert b.overlapped_runs == 1


def test_runs_in_other_processes_count_through_the_shared_table(tiny_entry: Path) -> None:
    """Server processes that share the cores (`serve --processes` on a CPU) count each other's runs in a table
    of shared memory: a batch that starts while another process computes takes the overlap session, one that
    starts while none does takes every core. Each process writes only its own slot."""
    peers = multiprocessing.get_context("spawn").RawArray("i", 2)
    repo = ModelRepository(tiny_entry.parent.parent)
    mine = onnx_engine("cpu", overlap_threads=1, runs=Runs(peers, 0))(repo.entry("tiny"))
    theirs = onnx_engine("cpu", overlap_threads=1, runs=Runs(peers, 1))(repo.entry("tiny"))
    assert isinstance(mine, OnnxEngine) and isinstance(theirs, OnnxEngine)

    mine.run(*batch(2, 9, seed=2))
    assert mine.overlapped_runs == 0 and list(peers) == [0, 0]
    peers[1] = 1  # the other process computes a batch
    mine.run(*batch(2, 9, seed=2))
    assert mine.overlapped_runs == 1 and list(peers) == [0, 1]
    peers[1] = 0

    with computing(theirs):
        assert list(peers) == [0, 1]  # its slot says it computes
        mine.run(*batch(2, 9, seed=2))
    assert (mine.overlapped_runs, theirs.overlapped_runs) == (2, 0)
    assert list(peers) == [0, 0]
    mine.run(*batch(2, 9, seed=2))  # alone again: every core
    assert mine.overlapped_runs == 2


def test_the_pool_threads_spin_only_while_a_batch_computes(tiny_entry: Path) -> None:
    """Spinning inside a run spares the second thread a wake-up at each operator (a short text one at a time
    ran 1.0-1.6 ms sooner); once the run returns the pool must stop, or the thread that spins on takes the
    core the event loop needs to answer and refuse requests. With ONNX Runtime's default (spinning on, no
    stop) the pool spun through these pauses: 476 ms of CPU in 0.5 s, against 0.7 ms with the stop."""
    eng = engine(tiny_entry, overlap_threads=None)
    ids, mask = batch(16, 160, seed=4)  # wide enough for ONNX Runtime to split the work over both threads
    eng.run(ids, mask)
    idle_cpu = 0.0
    for _ in range(10):
        eng.run(ids, mask)
        t0 = time.process_time()
        time.sleep(0.05)
        idle_cpu += time.process_time() - t0
    assert idle_cpu < 0.05, f"{idle_cpu * 1000:.0f} ms of CPU in 0.5 s between runs: the pool thread kept spinning"


def test_the_cuda_probe_graph_is_a_valid_onnx_model_that_runs() -> None:
    """cuda_loads answers no to a graph ONNX Runtime refuses, so a broken one would serve a GPU host on the CPU."""
    import onnx
    import onnxruntime as ort

    model = devices._identity_model()
    onnx.checker.check_model(onnx.load_from_string(model), full_check=True)
    x = np.arange(5, dtype=np.float32)
    (y,) = ort.InferenceSession(model, providers=[CPU]).run(None, {"x": x})
    np.testing.assert_array_equal(y, x)


@pytest.mark.usefixtures("gpu_without_cuda")
def test_a_host_showing_a_gpu_whose_cuda_does_not_load_is_served_as_a_cpu_host(
    tiny_entry: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It used to be served as a GPU host computing on the CPU: the GPU graph (`optimized`, not `optimized-cpu`),
    one inference worker (tests/cli/test_options.py), no overlap session, its threads never spinning, and ONNX
    Runtime's load error again for every session."""
    if cuda_loads():
        pytest.skip("CUDA loads here")
    assert not wants_cuda("auto") and wants_cuda("cuda")
    assert auto_graph(["fp32", "optimized", "optimized-cpu", "int8"], "auto") == "optimized-cpu"
    eng = OnnxEngine(
        tiny_entry / "model.onnx", max_seq_len=160, vocab_size=256, device="auto", intra_op_threads=1,
        overlap_threads=1,
    )  # fmt: skip
    assert eng.providers == [CPU] and eng.overlap_session is not None
    said = [r.getMessage() for r in caplog.records if "could not load CUDA" in r.getMessage()]
    assert len(said) == 1 and "--device auto serves on the CPU" in said[0], said
